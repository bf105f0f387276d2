//! The command's side of the store's operator endpoints (`docs/store-protocol.md`): lookup,
//! prefix search and purge over HTTP with the operator token. Every failure becomes a
//! sentence for the operator; nothing here panics on what the store answers.

use std::time::Duration;

use idempotency_protocol::wire::{
    encode_record, path, search, OutcomeResponse, Problem, PurgeResponse, RecordResponse,
    SearchResponse, SettleBody,
};
use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;

use super::{OPERATOR_TOKEN_ENV, TOKEN_ENV};
use crate::storage::{Digest, KeyPrefix};
use idempotency_protocol::record::Retention;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A prefix search on a large Redis keyspace takes up to about two seconds.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(15);

/// Where the token came from, so a refusal can say which one was refused.
#[derive(Debug, Clone)]
pub struct Token {
    pub secret: String,
    pub source: String,
}

pub struct StoreApi {
    client: reqwest::Client,
    base: String,
    token: Option<Token>,
}

impl StoreApi {
    /// `url` is the store's address (`http://127.0.0.1:8081`); a path in it is kept, for a
    /// store behind a proxy that routes by path.
    pub fn new(url: &str, token: Option<Token>) -> Result<Self, String> {
        let base = url.trim().trim_end_matches('/').to_owned();
        let parsed = reqwest::Url::parse(&base)
            .map_err(|e| format!("--store-url {url:?} is not a URL: {e}"))?;
        if parsed.scheme() != "http" {
            return Err(format!(
                "--store-url {url:?}: the store serves cleartext HTTP only (http://...)"
            ));
        }
        let client = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(|e| format!("cannot set up an HTTP client: {e}"))?;
        Ok(Self {
            client,
            base,
            token,
        })
    }

    fn url(&self, rest: &str) -> String {
        format!("{}{}{}{rest}", self.base, path::PREFIX, path::RECORDS)
    }

    /// The record under `key`, or None if the store has no live record for it.
    pub async fn lookup(&self, key: &Digest) -> Result<Option<RecordResponse>, String> {
        self.call(Method::GET, &format!("/{}", key.as_str())).await
    }

    /// Keys starting with `prefix`, as many as the store answers at most.
    pub async fn search(&self, prefix: &KeyPrefix) -> Result<SearchResponse, String> {
        let query = format!(
            "?{}={}&{}={}",
            search::PREFIX,
            prefix.as_str(),
            search::LIMIT,
            search::MAX_LIMIT
        );
        self.call(Method::GET, &query)
            .await?
            .ok_or_else(|| "the store does not know the prefix search (GET /v1/records?prefix=); is it older than this command?".to_owned())
    }

    /// Removes the record under `key`; None if there was no live record.
    pub async fn purge(&self, key: &Digest) -> Result<Option<PurgeResponse>, String> {
        self.call(Method::DELETE, &format!("/{}", key.as_str()))
            .await
    }

    /// Settles the unknown outcome `current` under `key`: replaced by `record` (kept for
    /// `retention` when given, else as long as `current` would have been, without a
    /// tombstone), or removed without one. Answers the store's outcome (`replaced`,
    /// `removed`).
    pub async fn settle(
        &self,
        key: &Digest,
        current: &[u8],
        record: Option<&[u8]>,
        retention: Option<Retention>,
    ) -> Result<String, String> {
        let body = SettleBody {
            key: None,
            current: encode_record(current),
            record: record.map(encode_record),
            ttl_ms: retention.map(|r| r.ttl_ms),
            tombstone_ms: retention.map_or(0, |r| r.tombstone_ms),
        };
        let rest = format!("/{}{}", key.as_str(), path::SETTLE);
        let answer: Option<OutcomeResponse> =
            self.call_with(Method::POST, &rest, Some(&body)).await?;
        answer
            .map(|a| a.outcome)
            .ok_or_else(|| "the store does not know settle (POST /v1/records/{key}/settle); is it older than this command?".to_owned())
    }

    /// One call; `Ok(None)` for a 404.
    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        rest: &str,
    ) -> Result<Option<T>, String> {
        self.call_with::<T, ()>(method, rest, None).await
    }

    /// `call`, with a JSON body.
    async fn call_with<T: DeserializeOwned, B: serde::Serialize>(
        &self,
        method: Method,
        rest: &str,
        body: Option<&B>,
    ) -> Result<Option<T>, String> {
        let url = self.url(rest);
        let mut request = self.client.request(method, &url);
        if let Some(body) = body {
            let json = serde_json::to_vec(body)
                .map_err(|e| format!("cannot write the request to the store: {e}"))?;
            request = request
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(json);
        }
        if let Some(token) = &self.token {
            request = request.bearer_auth(&token.secret);
        }
        let response = request.send().await.map_err(|e| {
            if e.is_timeout() {
                format!(
                    "the store at {} did not answer in time: {}",
                    self.base,
                    causes(&e)
                )
            } else {
                format!("cannot reach the store at {}: {}", self.base, causes(&e))
            }
        })?;
        let status = response.status();
        let body = response
            .bytes()
            .await
            .map_err(|e| format!("the store's answer was cut short: {e}"))?;
        match status {
            StatusCode::OK => serde_json::from_slice(&body)
                .map(Some)
                .map_err(|e| format!("the store answered something this command cannot read: {e}")),
            StatusCode::NOT_FOUND => Ok(None),
            StatusCode::UNAUTHORIZED => Err(match &self.token {
                Some(token) => format!(
                    "the store refused the token from {} (401): is it the store's operator \
                     token?",
                    token.source
                ),
                None => {
                    let mut message = format!(
                        "the store wants its operator token (401): pass --operator-token-file \
                         PATH or set {OPERATOR_TOKEN_ENV}"
                    );
                    if std::env::var_os(TOKEN_ENV).is_some() {
                        message.push_str(&format!(
                            " ({TOKEN_ENV} is the data-plane token, which operator routes \
                             do not accept)"
                        ));
                    }
                    message
                }
            }),
            // The store says why: the data-plane token, or operator routes it has disabled.
            StatusCode::FORBIDDEN => Err(format!(
                "the store refused {} (403): {}",
                self.token
                    .as_ref()
                    .map_or("the call".to_owned(), |t| format!(
                        "the token from {}",
                        t.source
                    )),
                problem_detail(&body)
            )),
            other => Err(format!(
                "the store answered {other}: {}",
                problem_detail(&body)
            )),
        }
    }
}

/// An error and what caused it ("connection refused" is in the cause, not the error).
fn causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// A problem's detail, or the start of whatever else the store sent.
fn problem_detail(body: &[u8]) -> String {
    match serde_json::from_slice::<Problem>(body) {
        Ok(problem) => problem.detail,
        Err(_) => String::from_utf8_lossy(body.get(..200).unwrap_or(body)).into_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_http_urls_are_taken() {
        let api = StoreApi::new("http://127.0.0.1:8081/", None).unwrap();
        let key = Digest::parse(&"a".repeat(64)).unwrap();
        assert_eq!(
            api.url(&format!("/{}", key.as_str())),
            format!("http://127.0.0.1:8081/v1/records/{}", key.as_str())
        );
        let behind = StoreApi::new("http://gw/idem", None).unwrap();
        assert_eq!(
            behind.url("?prefix=x"),
            "http://gw/idem/v1/records?prefix=x"
        );
        let https = StoreApi::new("https://store", None)
            .err()
            .unwrap_or_default();
        assert!(https.contains("cleartext"), "{https}");
        assert!(StoreApi::new("127.0.0.1:8081", None).is_err());
    }

    #[test]
    fn a_refusal_shows_the_problems_detail() {
        let body = br#"{"type":"t","title":"x","status":503,"detail":"the backend failed"}"#;
        assert_eq!(problem_detail(body), "the backend failed");
        assert_eq!(problem_detail(b"plain"), "plain");
    }
}

//! Every decision of the idempotency filter, with no dependency on the proxy-wasm host, so
//! it is tested natively and on wasm32 alike. The filter crate only moves bytes between
//! Envoy and these functions.
//!
//! A request's journey: [`rule_select`] picks the rule, [`key_source`] reads the key from
//! headers, query or body fields ([`request_fields`]), [`key`] parses and scopes it,
//! [`fingerprint`] hashes the payload, [`table`] claims the key in shared data ([`table_lineage`] keeps the tables a capacity change replaced), [`capture`]
//! collects the upstream response and [`record`] encodes it; in cluster mode
//! [`store_client`] speaks to the shared store. [`problem`] words every answer the filter
//! gives itself, [`outcome`] names what the metrics count, [`burst_log`] keeps failures from
//! flooding the log.
//!
//! What the filter and the store must agree on lives in the `idempotency-protocol` crate,
//! which both depend on: the digest type, the store protocol's wire types, and the
//! claim/complete/release decision that [`table`] follows as the store's backends do.

pub mod burst_log;
pub mod capture;
pub mod config;
#[cfg(test)]
mod fake_shared;
pub mod fingerprint;
pub mod key;
pub mod key_source;
pub mod outcome;
pub mod problem;
pub mod record;
pub mod request_fields;
pub mod response_policy;
pub mod rule_select;
pub mod store_client;
pub mod table;
pub mod table_lineage;
mod wire;

//! Every decision of the idempotency filter and the flow that strings them together, with no
//! dependency on the proxy-wasm host, so it is tested natively and on wasm32 alike. The
//! filter crate only feeds Envoy's callbacks in and implements [`host::Host`].
//!
//! A request's journey is [`journey`]: one state type and one transition function. Each
//! configuration is a [`plugin`] (rules resolved to handles, the table, store writes, the
//! root's life). The decisions they call: [`rule_select`] picks the rule,
//! [`naming::source`] reads the key from headers, query or body fields ([`naming::fields`])
//! and [`naming`] scopes it (both in the protocol crate, which the store shares),
//! [`fingerprint`] hashes the payload, [`table`] claims the key in shared data (its layout
//! within the byte budget, and the lineage of tables a capacity change replaced), [`capture`]
//! collects the upstream response and [`record`] encodes it; [`grpc`] is what a gRPC rule adds (framing,
//! statuses, its answers, the replay echo); in cluster mode [`store`] speaks to
//! the shared store (what it sends and reads, and the stream it travels on). [`problem`] words every answer the filter gives itself, [`outcome`]
//! names what the metrics count, [`burst_log`] keeps failures from flooding the log.
//!
//! [`naming`]: idempotency_protocol::naming
//! [`naming::source`]: idempotency_protocol::naming::source
//! [`naming::fields`]: idempotency_protocol::naming::fields
//! [`record`]: idempotency_protocol::record
//!
//! What the filter and the store must agree on lives in the `idempotency-protocol` crate,
//! which both depend on: the digest type, the store protocol's wire types, and the
//! claim/complete/release decision that [`table`] follows as the store's backends do.

pub mod burst_log;
pub mod capture;
pub mod config;
#[cfg(test)]
mod fake_host;
pub mod fingerprint;
pub mod gave_up;
pub mod grpc;
pub mod host;
pub mod journey;
pub mod lookup_route;
pub mod mail;
pub mod outcome;
pub mod plugin;
pub mod problem;
pub mod resolve;
pub mod response_policy;
pub mod root;
pub mod rule_handle;
pub mod rule_select;
pub mod store;
pub mod table;
pub mod who_answered;

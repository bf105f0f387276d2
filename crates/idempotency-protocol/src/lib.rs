//! What the idempotency filter and its store agree on, defined once: the digests both speak
//! in ([`digest`]), the store protocol's JSON bodies and the facts around them ([`wire`]:
//! outcome names, problem types, lease and TTL bounds), and the decision a claim, complete,
//! release or renew makes given what a key holds ([`decision`]), which the store's backends and the
//! filter's local table both follow. [`stream`] encodes the messages of the store's gRPC
//! stream for the filter.
//!
//! Host-free and runtime-free (no proxy-wasm, no async), so that it builds for wasm32 inside
//! the filter as well as natively inside the store.

pub mod decision;
pub mod digest;
pub mod grpc_status;
pub mod naming;
pub mod record;
pub mod stream;
pub mod wire;

pub use digest::Digest;

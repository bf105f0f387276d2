//! Shared store that Envoy idempotency filter replicas confirm their claims with.
//!
//! The crate is a library so the integration tests (and other workspace crates,
//! e.g. the filter's cluster-mode tests) can start the real router in-process.

pub mod admission;
pub mod clock;
pub mod command;
pub mod grpc;
pub mod metrics;
pub mod operator;
pub mod ops;
pub mod protocol;
pub mod server;
pub mod storage;
pub mod sweeper;
pub mod waits;

//! What the fuzz targets check: one public function per parser or codec that reads bytes from
//! outside the filter or the store, each taking the fuzzer's input as it is. Every function
//! parses the bytes and asserts a property, not only "no crash": a decode of an encode gives
//! back what was encoded, a configuration that parses renders and parses to the same one,
//! two different field values never give the same key, and so on. Most also build a value
//! from the same bytes with `arbitrary` and check it round-trips, so the fuzzer explores both
//! the raw parser and the structured values it exists for.
//!
//! The cargo-fuzz crate (`fuzz/`, nightly) only calls these; the replay test
//! (`tests/corpus.rs`) runs the committed corpus and regressions through them on stable, so
//! `cargo test --workspace` keeps every input ever found passing. [`TARGETS`] names them all.

// A failed property must crash the fuzzer, so this crate asserts, panics and indexes where
// the rest of the workspace may not; it never runs inside the filter or the store.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

mod gen;
mod grpc_framing;
mod key_header;
mod key_sources;
mod plugin_config;
mod record_codec;
mod request_fields;
mod store_answers;
mod store_requests;
mod table_codecs;

pub use grpc_framing::grpc_framing;
pub use key_header::key_header;
pub use key_sources::key_sources;
pub use plugin_config::plugin_config;
pub use record_codec::record_codec;
pub use request_fields::request_fields;
pub use store_answers::{store_answer_http, store_answer_stream};
pub use store_requests::{store_request_http, store_request_stream};
pub use table_codecs::table_codecs;

/// A check: it returns when the property holds for the input and panics when it does not.
pub type Check = fn(&[u8]);

/// Every fuzz target by name, as `fuzz/fuzz_targets/<name>.rs`, `fuzz/corpus/<name>/` and
/// `fuzz/regressions/<name>/` name it.
pub const TARGETS: &[(&str, Check)] = &[
    ("key_header", key_header),
    ("request_fields", request_fields),
    ("key_sources", key_sources),
    ("plugin_config", plugin_config),
    ("table_codecs", table_codecs),
    ("record_codec", record_codec),
    ("grpc_framing", grpc_framing),
    ("store_answer_http", store_answer_http),
    ("store_answer_stream", store_answer_stream),
    ("store_request_http", store_request_http),
    ("store_request_stream", store_request_stream),
];

//! What a protected request leaves for Envoy's own access log, so that on-call can tell from
//! a log line which rule protected a request, what the filter decided, and which stored
//! record it was (the same short hash for every retry of the same key, and the prefix of
//! the key the store keeps, so `idempotency-store record` finds it).
//!
//! Each value is filter state `wasm.<name>`, read with `%FILTER_STATE(wasm.<name>:PLAIN)%`.
//! Nothing secret is published: the hash is of the SHA-256 storage key, which already hides
//! the raw key and the caller's credentials.

use std::cell::RefCell;

use crate::host::Host;
use crate::outcome::Outcome;
use idempotency_protocol::naming::Digest;

/// The rule that protected the request.
pub const RULE: &str = "idempotency_rule";
/// What the filter decided, in order: `executed`, `replayed`, `executed+released`,
/// `store_error+store_fail_open+executed`, ...
pub const OUTCOME: &str = "idempotency_outcome";
/// The first [`KEY_HASH_HEX`] hex digits of the storage key.
pub const KEY_HASH: &str = "idempotency_key_hash";
pub const KEY_HASH_HEX: usize = idempotency_protocol::naming::SHORT_HASH_HEX;

pub fn key_hash(key: &Digest) -> String {
    idempotency_protocol::naming::short_hash(key)
}

pub fn publish_rule(host: &impl Host, rule: &str) {
    host.publish(RULE, rule.as_bytes());
}

pub fn publish_key(host: &impl Host, key: &Digest) {
    host.publish(KEY_HASH, key_hash(key).as_bytes());
}

/// The outcomes of one request so far; each one added is published with all before it.
#[derive(Default)]
pub struct Decisions(RefCell<String>);

impl Decisions {
    pub fn add(&self, host: &impl Host, outcome: Outcome) {
        let mut all = self.0.borrow_mut();
        if !all.is_empty() {
            all.push('+');
        }
        all.push_str(outcome.name());
        host.publish(OUTCOME, all.as_bytes());
    }
}

//! Property tests of the claim table: random sequences of claims, completions, releases and
//! clock moves, from two workers' tables over one shared-data model with the host's CAS
//! rules, on a table small enough that keys evict each other. Whatever the sequence:
//! - a key never has two owners whose leases are both live;
//! - a replay is always the response recorded for that key (never another key's);
//! - a recorded response stays replayable until its TTL, unless an eviction was counted.

use std::collections::HashMap;

use proptest::prelude::*;

use crate::fake_shared::FakeShared;
use crate::key::Digest;
use crate::record::RecordedResponse;
use crate::table::{Claim, Completion, Held, OversizedBody, Table};
use crate::table_layout::Layout;

const LEASE_MS: u64 = 1_000;
const TTL_MS: u64 = 5_000;
/// More keys than the table's 16 slots: completed records are evicted.
const KEYS: u8 = 24;

#[derive(Debug, Clone)]
enum Op {
    Claim { worker: usize, key: u8, fp: u8 },
    Complete { request: usize },
    Release { request: usize },
    Advance { ms: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..2usize, 0..KEYS, 0..2u8).prop_map(|(worker, key, fp)| Op::Claim { worker, key, fp }),
        3 => (0..64usize).prop_map(|request| Op::Complete { request }),
        1 => (0..64usize).prop_map(|request| Op::Release { request }),
        2 => (0..1_500u64).prop_map(|ms| Op::Advance { ms }),
    ]
}

fn digest(tag: u8, n: u8) -> Digest {
    let mut d = [tag; 32];
    d[0] = n;
    d
}

/// The body names the key and the request that recorded it.
fn body(key: u8, owner: u64) -> Vec<u8> {
    format!("key {key} by {owner}").into_bytes()
}

struct Request {
    key: u8,
    fp: u8,
    held: Held,
    claimed_at: u64,
    done: bool,
}

struct Recorded {
    fp: u8,
    at: u64,
    evictions_then: u64,
}

fn run(ops: &[Op]) -> Result<(), TestCaseError> {
    let shared = FakeShared::default();
    let layout = Layout::plan(1 << 20, Some(16), 4 << 10)
        .map_err(|e| TestCaseError::fail(format!("layout: {e:?}")))?;
    // Two workers: two tables over the same shared data (same namespace and salt).
    let workers = (
        Table::new("prop", layout.clone(), 7),
        Table::new("prop", layout, 7),
    );
    workers
        .0
        .create_buckets(&shared)
        .map_err(|e| TestCaseError::fail(e.0))?;
    let mut now = 1_000_000u64;
    let mut next_owner = 1u64;
    let mut requests: Vec<Request> = Vec::new();
    let mut recorded: HashMap<u8, Recorded> = HashMap::new();
    let mut evictions = 0u64;

    for op in ops {
        match *op {
            Op::Advance { ms } => now += ms,
            Op::Claim { worker, key, fp } => {
                let table = if worker == 0 { &workers.0 } else { &workers.1 };
                let owner = next_owner;
                next_owner += 1;
                let claim = table
                    .claim(
                        &shared,
                        &digest(1, key),
                        &digest(2, fp),
                        owner,
                        now,
                        LEASE_MS,
                    )
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                match claim {
                    Claim::Claimed(held) => {
                        if held.evicted.is_some() {
                            evictions += 1;
                        }
                        let rival = requests
                            .iter()
                            .find(|r| r.key == key && !r.done && r.claimed_at + LEASE_MS > now);
                        prop_assert!(rival.is_none(), "two live owners of key {key}");
                        if let Some(rec) = recorded.get(&key) {
                            prop_assert!(
                                rec.fp != fp
                                    || now >= rec.at + TTL_MS
                                    || evictions > rec.evictions_then,
                                "key {key}'s record lost before its TTL without an eviction"
                            );
                        }
                        requests.push(Request {
                            key,
                            fp,
                            held,
                            claimed_at: now,
                            done: false,
                        });
                    }
                    Claim::Completed {
                        slot, owner: by, ..
                    } => {
                        if let Some(replay) = table
                            .load_response(&shared, slot, by)
                            .map_err(|e| TestCaseError::fail(e.0))?
                        {
                            prop_assert_eq!(replay.body, body(key, by), "replay of another key");
                        }
                        let rec = recorded.get(&key);
                        prop_assert!(
                            rec.is_some_and(|r| r.fp == fp),
                            "replay of nothing recorded"
                        );
                    }
                    Claim::InFlight { .. } | Claim::Mismatch | Claim::Full => {}
                }
            }
            Op::Complete { request } | Op::Release { request } => {
                let Some(r) = requests.get_mut(request) else {
                    continue;
                };
                if r.done {
                    continue;
                }
                r.done = true;
                let table = if request % 2 == 0 {
                    &workers.0
                } else {
                    &workers.1
                };
                if matches!(op, Op::Release { .. }) {
                    table
                        .release(&shared, &r.held)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    continue;
                }
                let response = RecordedResponse {
                    owner: r.held.owner,
                    status: 201,
                    headers: Vec::new(),
                    body: body(r.key, r.held.owner),
                    body_omitted: false,
                };
                let done = table
                    .complete(
                        &shared,
                        &r.held,
                        &response,
                        now,
                        TTL_MS,
                        OversizedBody::RecordWithoutIt,
                    )
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                if done == Completion::Recorded {
                    recorded.insert(
                        r.key,
                        Recorded {
                            fp: r.fp,
                            at: now,
                            evictions_then: evictions,
                        },
                    );
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn the_table_keeps_its_promises_under_any_interleaving(ops in prop::collection::vec(op(), 1..200)) {
        run(&ops)?;
    }
}

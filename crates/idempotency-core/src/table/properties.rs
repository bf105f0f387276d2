//! Property tests of the claim table: random sequences of claims, completions, releases and
//! clock moves, from two workers' tables over one shared-data model with the host's CAS
//! rules, on a table small enough that keys evict each other. A race puts one worker's whole
//! operation between another's read and one of its writes (as Envoy's workers can), so the
//! CAS retry loops run too. Whatever the sequence:
//! - a key never has two owners whose leases are both live;
//! - a replay is always the response recorded for that key (never another key's);
//! - a recorded response stays replayable until its TTL, unless an eviction was counted;
//! - a mismatch is answered only when the key is held for another payload.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use proptest::prelude::*;

use crate::table::fake_shared::FakeShared;
use crate::table::layout::Layout;
use crate::table::{Claim, Completion, Held, OversizedBody, Table};
use idempotency_protocol::naming::Digest;
use idempotency_protocol::record::RecordedResponse;

const LEASE_MS: u64 = 1_000;
const TTL_MS: u64 = 5_000;
/// More keys than the table's 16 slots: completed records are evicted.
const KEYS: u8 = 24;

/// One table operation of one worker.
#[derive(Debug, Clone)]
enum Step {
    Claim { worker: usize, key: u8, fp: u8 },
    Complete { request: usize },
    Release { request: usize },
}

#[derive(Debug, Clone)]
enum Op {
    Alone(Step),
    /// `rival` runs whole just before `first`'s write number `at_write` (0 = its first).
    Race {
        first: Step,
        rival: Step,
        at_write: u32,
    },
    Advance {
        ms: u64,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0..2usize, 0..KEYS, 0..2u8).prop_map(|(worker, key, fp)| Step::Claim { worker, key, fp }),
        3 => (0..64usize).prop_map(|request| Step::Complete { request }),
        1 => (0..64usize).prop_map(|request| Step::Release { request }),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => step().prop_map(Op::Alone),
        3 => (step(), step(), 0..4u32).prop_map(|(first, rival, at_write)| Op::Race { first, rival, at_write }),
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
    worker: usize,
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

/// What the test knows: the requests made so far and what they recorded.
struct Model {
    now: u64,
    next_owner: u64,
    requests: Vec<Request>,
    recorded: HashMap<u8, Recorded>,
    evictions: u64,
}

/// A step made ready to run against the tables, which need nothing else from the model.
#[allow(clippy::large_enum_variant)] // test-only, short-lived
enum Prepared {
    Claim {
        worker: usize,
        key: u8,
        fp: u8,
        owner: u64,
    },
    Finish {
        worker: usize,
        request: usize,
        held: Held,
        /// None: release.
        response: Option<RecordedResponse>,
    },
}

impl Prepared {
    fn worker(&self) -> usize {
        match self {
            Prepared::Claim { worker, .. } | Prepared::Finish { worker, .. } => *worker,
        }
    }

    fn request(&self) -> Option<usize> {
        match self {
            Prepared::Claim { .. } => None,
            Prepared::Finish { request, .. } => Some(*request),
        }
    }
}

/// What the tables answered, to be checked against the model.
#[allow(clippy::large_enum_variant)] // test-only, short-lived
enum Executed {
    Claim {
        worker: usize,
        key: u8,
        fp: u8,
        claim: Claim,
        /// The response a completed claim found, read at once as the filter does.
        replay: Option<RecordedResponse>,
    },
    Finish {
        request: usize,
        /// Release answers `Recorded` too when it freed the claim.
        released: bool,
        completion: Completion,
    },
}

struct Tables {
    shared: FakeShared,
    workers: [Table; 2],
}

impl Model {
    fn prepare(&mut self, step: &Step) -> Option<Prepared> {
        match *step {
            Step::Claim { worker, key, fp } => {
                let owner = self.next_owner;
                self.next_owner += 1;
                Some(Prepared::Claim {
                    worker,
                    key,
                    fp,
                    owner,
                })
            }
            Step::Complete { request } | Step::Release { request } => {
                let r = self.requests.get(request).filter(|r| !r.done)?;
                let response = matches!(step, Step::Complete { .. }).then(|| RecordedResponse {
                    owner: r.held.owner,
                    status: 201,
                    headers: Vec::new(),
                    body: body(r.key, r.held.owner),
                    trailers: Vec::new(),
                    body_omitted: false,
                    unknown: None,
                });
                Some(Prepared::Finish {
                    worker: r.worker,
                    request,
                    held: r.held.clone(),
                    response,
                })
            }
        }
    }

    fn apply(&mut self, executed: Executed) -> Result<(), TestCaseError> {
        let now = self.now;
        match executed {
            Executed::Claim {
                worker,
                key,
                fp,
                claim,
                replay,
            } => match claim {
                Claim::Claimed(held) => {
                    if held.evicted.is_some() {
                        self.evictions += 1;
                    }
                    let rival = self
                        .requests
                        .iter()
                        .find(|r| r.key == key && !r.done && r.claimed_at + LEASE_MS > now);
                    prop_assert!(rival.is_none(), "two live owners of key {key}");
                    if let Some(rec) = self.recorded.get(&key) {
                        prop_assert!(
                            now >= rec.at + TTL_MS || self.evictions > rec.evictions_then,
                            "key {key}'s record lost before its TTL without an eviction"
                        );
                    }
                    self.requests.push(Request {
                        worker,
                        key,
                        fp,
                        held,
                        claimed_at: now,
                        done: false,
                    });
                }
                Claim::Completed { owner: by, .. } => {
                    if let Some(replay) = replay {
                        prop_assert_eq!(replay.body, body(key, by), "replay of another key");
                    }
                    let rec = self.recorded.get(&key);
                    prop_assert!(
                        rec.is_some_and(|r| r.fp == fp),
                        "replay of nothing recorded"
                    );
                }
                Claim::Mismatch => {
                    let live_record = self
                        .recorded
                        .get(&key)
                        .is_some_and(|r| r.fp != fp && now < r.at + TTL_MS);
                    // A claim in flight may hold the key a little past its lease while it
                    // records (the table renews it for that), so any unfinished one counts.
                    let in_flight = self
                        .requests
                        .iter()
                        .any(|r| r.key == key && r.fp != fp && !r.done);
                    prop_assert!(
                        live_record || in_flight,
                        "mismatch for key {key} with nothing held for another payload"
                    );
                }
                Claim::InFlight { .. } | Claim::Full { .. } => {}
            },
            Executed::Finish {
                request,
                released,
                completion,
            } => {
                let Some(r) = self.requests.get_mut(request) else {
                    return Ok(());
                };
                r.done = true;
                if completion == Completion::Recorded && !released {
                    let (key, fp) = (r.key, r.fp);
                    self.recorded.insert(
                        key,
                        Recorded {
                            fp,
                            at: now,
                            evictions_then: self.evictions,
                        },
                    );
                }
            }
        }
        Ok(())
    }
}

impl Tables {
    fn execute(&self, prepared: Prepared, now: u64) -> Result<Executed, String> {
        let Some(table) = self.workers.get(prepared.worker()) else {
            return Err("no such worker".into());
        };
        let shared = &self.shared;
        match prepared {
            Prepared::Claim {
                worker,
                key,
                fp,
                owner,
            } => {
                let claim = table
                    .claim(
                        shared,
                        &digest(1, key),
                        &digest(2, fp),
                        owner,
                        now,
                        LEASE_MS,
                        || {},
                    )
                    .map_err(|e| e.to_string())?;
                let replay = match claim {
                    Claim::Completed { slot, owner, .. } => {
                        table.load_response(shared, slot, owner).map_err(|e| e.0)?
                    }
                    _ => None,
                };
                Ok(Executed::Claim {
                    worker,
                    key,
                    fp,
                    claim,
                    replay,
                })
            }
            Prepared::Finish {
                request,
                held,
                response,
                ..
            } => {
                let released = response.is_none();
                let completion = match response {
                    Some(response) => table.complete(
                        shared,
                        &held,
                        &response,
                        now,
                        TTL_MS,
                        OversizedBody::RecordWithoutIt,
                    ),
                    None => table.release(shared, &held),
                }
                .map_err(|e| e.to_string())?;
                Ok(Executed::Finish {
                    request,
                    released,
                    completion,
                })
            }
        }
    }
}

fn run(ops: &[Op]) -> Result<(), TestCaseError> {
    let layout = Layout::plan(1 << 20, Some(16), 4 << 10)
        .map_err(|e| TestCaseError::fail(format!("layout: {e:?}")))?;
    // Two workers: two tables over the same shared data (same namespace and salt).
    let tables = Rc::new(Tables {
        shared: FakeShared::default(),
        workers: [
            Table::new("prop", layout.clone(), 7),
            Table::new("prop", layout, 7),
        ],
    });
    tables.workers[0]
        .create_buckets(&tables.shared)
        .map_err(|e| TestCaseError::fail(e.0))?;
    let mut model = Model {
        now: 1_000_000,
        next_owner: 1,
        requests: Vec::new(),
        recorded: HashMap::new(),
        evictions: 0,
    };
    let fail = TestCaseError::fail;

    for op in ops {
        match op {
            Op::Advance { ms } => model.now += ms,
            Op::Alone(step) => {
                if let Some(prepared) = model.prepare(step) {
                    let executed = tables.execute(prepared, model.now).map_err(fail)?;
                    model.apply(executed)?;
                }
            }
            Op::Race {
                first,
                rival,
                at_write,
            } => {
                let (Some(first), Some(rival)) = (model.prepare(first), model.prepare(rival))
                else {
                    continue;
                };
                // A worker runs one callback at a time: only another worker can interleave,
                // and two steps of one request never run at once.
                let sequential = first.worker() == rival.worker()
                    || (first.request().is_some() && first.request() == rival.request());
                let now = model.now;
                if sequential {
                    let executed = tables.execute(first, now).map_err(fail)?;
                    model.apply(executed)?;
                    let executed = tables.execute(rival, now).map_err(fail)?;
                    model.apply(executed)?;
                    continue;
                }
                let rival_result: Rc<RefCell<Option<Result<Executed, String>>>> = Rc::default();
                let (rival_tables, rival_out) = (Rc::clone(&tables), Rc::clone(&rival_result));
                tables.shared.before_write(
                    *at_write,
                    Box::new(move |_| {
                        *rival_out.borrow_mut() = Some(rival_tables.execute(rival, now));
                    }),
                );
                let first_result = tables.execute(first, now);
                let ran_between = match tables.shared.disarm() {
                    None => true,
                    // The first made fewer writes: the rival simply comes after it.
                    Some(rival) => {
                        rival(&tables.shared);
                        false
                    }
                };
                let rival_executed = rival_result
                    .borrow_mut()
                    .take()
                    .ok_or_else(|| fail("the rival never ran".into()))?
                    .map_err(fail)?;
                // Every step's last write is the one that commits it, so a rival that ran
                // before it committed first.
                if ran_between {
                    model.apply(rival_executed)?;
                    model.apply(first_result.map_err(fail)?)?;
                } else {
                    model.apply(first_result.map_err(fail)?)?;
                    model.apply(rival_executed)?;
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

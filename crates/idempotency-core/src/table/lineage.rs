//! Which local tables exist in this Envoy process, so a change of `local_table.capacity` or
//! `max_bytes` neither loses the records of the table it replaces nor strands its memory.
//!
//! A table's key names carry its layout, so a new layout means a new table. Shared data
//! has no delete and no key listing: only this registry (one key, changed by CAS like the
//! buckets) remembers the tables that came before. A replaced table is *retired*: the new
//! table still answers from it (a retry of a write recorded before the change replays, a
//! write still in flight there gets 409) until the longest lease plus TTL it served has
//! passed, and then its buckets and responses are emptied, a few buckets per tick of the
//! root context.

use crate::host::{HostError, SetOutcome, SharedData};
use crate::table::layout::Layout;
use crate::table::Table;

/// Retired tables remembered at most; an older one is reclaimed at once (its records lost).
pub const MAX_RETIRED: usize = 4;
const MAX_CAS_ATTEMPTS: usize = 32;

/// One table in the registry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableEntry {
    pub layout: Layout,
    /// How long a record of this table can live after its claim, at most: the longest
    /// lease plus the longest TTL any configuration using it had (a claim made just before
    /// the table was retired may complete a lease later).
    pub record_life_ms: u64,
    /// When it was replaced; None for the table in use.
    pub retired_at_ms: Option<u64>,
}

impl TableEntry {
    /// When every record it can hold has expired.
    pub fn reclaimable_at_ms(&self) -> Option<u64> {
        self.retired_at_ms
            .map(|at| at.saturating_add(self.record_life_ms))
    }
}

/// What registering the table of a new configuration found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Lineage {
    /// Retired tables whose records may still be live, newest first.
    pub retired: Vec<TableEntry>,
    /// Retired tables this call removed from the registry: the caller empties them.
    pub to_reclaim: Vec<TableEntry>,
}

fn registry_key(namespace: &str) -> String {
    format!("{namespace}/idempotency/v2/tables")
}

/// The registry's value: one line per table. Public (with [`encode`]) only for the fuzz
/// targets (`crates/fuzz-checks`).
#[doc(hidden)]
pub fn decode(bytes: &[u8]) -> Vec<TableEntry> {
    let text = std::str::from_utf8(bytes).unwrap_or("");
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let layout = Layout::parse(fields.next()?)?;
            let record_life_ms = fields.next()?.parse().ok()?;
            let retired = fields.next()?.parse::<u64>().ok()?;
            Some(TableEntry {
                layout,
                record_life_ms,
                retired_at_ms: (retired != 0).then_some(retired),
            })
        })
        .collect()
}

#[doc(hidden)]
pub fn encode(entries: &[TableEntry]) -> Vec<u8> {
    entries
        .iter()
        .map(|e| {
            format!(
                "{} {} {}\n",
                e.layout.tag(),
                e.record_life_ms,
                e.retired_at_ms.unwrap_or(0)
            )
        })
        .collect::<String>()
        .into_bytes()
}

/// Records `table` as the one in use, retiring the previous one if its geometry differs, and
/// takes retired tables whose records have all expired off the registry.
pub fn register(
    shared: &impl SharedData,
    namespace: &str,
    table: &Table,
    record_life_ms: u64,
    now_ms: u64,
) -> Result<Lineage, HostError> {
    let key = registry_key(namespace);
    for _ in 0..MAX_CAS_ATTEMPTS {
        let stored = shared.get(&key)?;
        let (entries, cas) = match &stored {
            Some((bytes, cas)) => (decode(bytes), Some(*cas)),
            // Absent: a write creates it, and the host's create is not protected by a cas,
            // so a concurrent first configure may overwrite it; the entries it loses are
            // only retired tables, which nothing has retired yet at first start.
            None => (Vec::new(), None),
        };
        let mut current = TableEntry {
            layout: table.layout().clone(),
            record_life_ms,
            retired_at_ms: None,
        };
        let mut retired = Vec::new();
        for entry in entries {
            if entry.layout == current.layout {
                // This very table again (the same layout, or back to an earlier one): its
                // records are still valid, and it must outlive the longest record life it served.
                current.record_life_ms = current.record_life_ms.max(entry.record_life_ms);
                continue;
            }
            retired.push(match entry.retired_at_ms {
                Some(_) => entry,
                None => TableEntry {
                    retired_at_ms: Some(now_ms),
                    ..entry
                },
            });
        }
        // Newest first, so the table most likely to hold a key is asked first.
        retired.sort_by_key(|e| std::cmp::Reverse(e.retired_at_ms));
        let mut to_reclaim = Vec::new();
        let mut kept = Vec::new();
        for entry in retired {
            let expired = entry.reclaimable_at_ms().is_some_and(|at| now_ms >= at);
            if expired || kept.len() >= MAX_RETIRED {
                to_reclaim.push(entry);
            } else {
                kept.push(entry);
            }
        }
        let mut all = vec![current];
        all.extend(kept.iter().cloned());
        let value = encode(&all);
        let unchanged = stored.is_some_and(|(bytes, _)| bytes == value);
        if unchanged || shared.set(&key, &value, cas)? == SetOutcome::Stored {
            return Ok(Lineage {
                retired: kept,
                to_reclaim,
            });
        }
    }
    Err(HostError("table registry stayed contended".to_string()))
}

/// Keeps one configuration's table in step with the registry.
///
/// Why not only at configure: when a push brings back a configuration Envoy still holds
/// (capacity A, then B, then A again), Envoy reuses A's root context without configuring it
/// again; that table must still learn of B's records. So every claim first looks at the
/// registry's cas (one small read) and re-registers when another configuration changed it.
pub struct LineageWatch {
    namespace: String,
    record_life_ms: u64,
    seen_cas: std::cell::Cell<Option<u32>>,
}

impl LineageWatch {
    pub fn new(namespace: &str, record_life_ms: u64) -> LineageWatch {
        LineageWatch {
            namespace: namespace.to_string(),
            record_life_ms,
            seen_cas: std::cell::Cell::new(None),
        }
    }

    /// Registers `table` (at configure); the caller empties `to_reclaim`.
    pub fn adopt(
        &self,
        shared: &impl SharedData,
        table: &Table,
        now_ms: u64,
    ) -> Result<Lineage, HostError> {
        let lineage = register(shared, &self.namespace, table, self.record_life_ms, now_ms)?;
        table.set_predecessors(
            lineage
                .retired
                .iter()
                .map(|e| Table::new(&self.namespace, e.layout.clone(), table.salt()))
                .collect(),
        );
        self.seen_cas.set(
            shared
                .get(&registry_key(&self.namespace))?
                .map(|(_, cas)| cas),
        );
        Ok(lineage)
    }

    /// Before a claim: re-registers `table` if another configuration changed the registry
    /// since. Returns the new lineage when it did.
    pub fn refresh(
        &self,
        shared: &impl SharedData,
        table: &Table,
        now_ms: u64,
    ) -> Result<Option<Lineage>, HostError> {
        let cas = shared
            .get(&registry_key(&self.namespace))?
            .map(|(_, cas)| cas);
        if cas == self.seen_cas.get() {
            return Ok(None);
        }
        self.adopt(shared, table, now_ms).map(Some)
    }
}

/// Takes retired tables whose records have all expired off the registry (for the root's
/// tick, so a process that sees no new configuration still frees them); the caller empties
/// what is returned. Only one caller gets each table: the registry changes by CAS.
pub fn reclaim_due(
    shared: &impl SharedData,
    namespace: &str,
    now_ms: u64,
) -> Result<Vec<TableEntry>, HostError> {
    let key = registry_key(namespace);
    for _ in 0..MAX_CAS_ATTEMPTS {
        let Some((bytes, cas)) = shared.get(&key)? else {
            return Ok(Vec::new());
        };
        let (due, keep): (Vec<TableEntry>, Vec<TableEntry>) = decode(&bytes)
            .into_iter()
            .partition(|e| e.reclaimable_at_ms().is_some_and(|at| now_ms >= at));
        if due.is_empty() {
            return Ok(due);
        }
        if shared.set(&key, &encode(&keep), Some(cas))? == SetOutcome::Stored {
            return Ok(due);
        }
    }
    Err(HostError("table registry stayed contended".to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::fake_shared::FakeShared;
    use crate::table::OversizedBody::RecordWithoutIt;
    use crate::table::{Claim, Completion};
    use idempotency_protocol::naming::Digest;
    use idempotency_protocol::record::RecordedResponse;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    type Shared = FakeShared;

    const DAY: u64 = 86_400_000;

    fn configure(shared: &Shared, capacity: u32, ttl_ms: u64, now_ms: u64) -> (Table, Lineage) {
        let (table, _, lineage) = configure_watched(shared, capacity, ttl_ms, now_ms);
        (table, lineage)
    }

    fn configure_watched(
        shared: &Shared,
        capacity: u32,
        ttl_ms: u64,
        now_ms: u64,
    ) -> (Table, LineageWatch, Lineage) {
        let table = Table::new("ns", layout(u64::from(capacity)), 0);
        table.create_buckets(shared).unwrap();
        let watch = LineageWatch::new("ns", ttl_ms);
        let lineage = watch.adopt(shared, &table, now_ms).unwrap();
        for old in &lineage.to_reclaim {
            let old = Table::new("ns", old.layout.clone(), 0);
            let mut next = Some(0);
            while let Some(first) = next {
                next = old.empty_buckets(shared, first, 3).unwrap();
            }
        }
        (table, watch, lineage)
    }

    #[test]
    fn a_configuration_brought_back_without_configure_learns_of_the_newer_table() {
        let s = Shared::default();
        let (a, a_watch, _) = configure_watched(&s, 64, DAY, 0);
        assert_eq!(a_watch.refresh(&s, &a, 1).unwrap(), None);
        let (b, b_watch, _) = configure_watched(&s, 1024, DAY, 10);
        let h = match b.claim(&s, &d(5), &d(9), 1, 20, 60_000, || {}).unwrap() {
            Claim::Claimed(h) => h,
            other => panic!("{other:?}"),
        };
        b.complete(&s, &h, &response(), 21, DAY, RecordWithoutIt)
            .unwrap();
        // Envoy serves A's root context again, without configuring it.
        let lineage = a_watch.refresh(&s, &a, 30).unwrap().unwrap();
        assert_eq!(lineage.retired.len(), 1);
        assert!(matches!(
            a.claim(&s, &d(5), &d(9), 2, 40, 60_000, || {}).unwrap(),
            Claim::Completed { .. }
        ));
        // Nothing changed since: no re-registration on the next claim.
        assert_eq!(a_watch.refresh(&s, &a, 50).unwrap(), None);
        // B, still draining a connection, sees the change and takes the registry back; its
        // own records are unaffected.
        b_watch.refresh(&s, &b, 60).unwrap().unwrap();
        assert!(matches!(
            b.claim(&s, &d(5), &d(9), 3, 70, 60_000, || {}).unwrap(),
            Claim::Completed { .. }
        ));
    }

    fn layout(capacity: u64) -> Layout {
        Layout::plan(64 << 20, Some(capacity), 1 << 20).unwrap()
    }

    fn d(n: u8) -> Digest {
        [n; 32]
    }

    fn response() -> RecordedResponse {
        RecordedResponse {
            owner: 0,
            status: 201,
            headers: vec![],
            body: vec![7; 10_000],
            trailers: Vec::new(),
            body_omitted: false,
            unknown: None,
        }
    }

    #[test]
    fn the_same_capacity_keeps_one_table() {
        let s = Shared::default();
        let (_, first) = configure(&s, 64, DAY, 0);
        let (_, again) = configure(&s, 64, DAY, 10);
        assert_eq!(first, Lineage::default());
        assert_eq!(again, Lineage::default());
    }

    #[test]
    fn a_new_capacity_still_replays_and_blocks_what_the_old_table_holds() {
        let s = Shared::default();
        let (old, _) = configure(&s, 64, DAY, 0);
        let done = match old.claim(&s, &d(1), &d(9), 1, 0, 60_000, || {}).unwrap() {
            Claim::Claimed(h) => h,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            old.complete(&s, &done, &response(), 1, DAY, RecordWithoutIt)
                .unwrap(),
            Completion::Recorded
        );
        assert!(matches!(
            old.claim(&s, &d(2), &d(9), 2, 2, 60_000, || {}).unwrap(),
            Claim::Claimed(_)
        ));

        let (new, lineage) = configure(&s, 1024, DAY, 1_000);
        assert_eq!(lineage.retired.len(), 1);
        let Claim::Completed {
            slot,
            owner,
            status,
            ..
        } = new
            .claim(&s, &d(1), &d(9), 3, 2_000, 60_000, || {})
            .unwrap()
        else {
            panic!("the record of the old table must replay");
        };
        assert_eq!(status, 201);
        assert_eq!(
            new.load_response(&s, slot, owner).unwrap().unwrap().body,
            vec![7; 10_000]
        );
        assert_eq!(
            new.claim(&s, &d(1), &d(8), 3, 2_000, 60_000, || {})
                .unwrap(),
            Claim::Mismatch
        );
        assert!(matches!(
            new.claim(&s, &d(2), &d(9), 4, 2_000, 60_000, || {})
                .unwrap(),
            Claim::InFlight { .. }
        ));
        assert!(matches!(
            new.claim(&s, &d(3), &d(9), 5, 2_000, 60_000, || {})
                .unwrap(),
            Claim::Claimed(_)
        ));
    }

    #[test]
    fn a_retired_table_is_emptied_once_its_longest_ttl_has_passed() {
        let s = Shared::default();
        let (old, _) = configure(&s, 64, DAY, 0);
        let h = match old.claim(&s, &d(1), &d(9), 1, 0, 60_000, || {}).unwrap() {
            Claim::Claimed(h) => h,
            other => panic!("{other:?}"),
        };
        old.complete(&s, &h, &response(), 1, DAY, RecordWithoutIt)
            .unwrap();
        let old_prefix = format!("ns/idempotency/v2/{}/", layout(64).tag());
        let old_prefix = old_prefix.as_str();
        assert!(s.bytes_under(old_prefix) > 10_000);

        let (_, lineage) = configure(&s, 1024, DAY / 2, 1_000);
        assert_eq!(lineage.to_reclaim, vec![]);
        // Still within the old table's TTL (a day, not the new half day): kept.
        let (_, lineage) = configure(&s, 1024, DAY / 2, DAY);
        assert_eq!(lineage.retired.len(), 1);
        let (_, lineage) = configure(&s, 1024, DAY / 2, DAY + 1_000);
        assert_eq!(lineage.retired, vec![]);
        assert_eq!(lineage.to_reclaim.len(), 1);
        assert_eq!(s.bytes_under(old_prefix), 0);
    }

    #[test]
    fn the_tick_reclaims_an_expired_table_once() {
        let s = Shared::default();
        configure(&s, 64, DAY, 0);
        configure(&s, 1024, DAY, 1_000);
        assert_eq!(reclaim_due(&s, "ns", DAY).unwrap(), vec![]);
        let due = reclaim_due(&s, "ns", DAY + 1_000).unwrap();
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].layout.buckets, 8);
        assert_eq!(reclaim_due(&s, "ns", DAY + 2_000).unwrap(), vec![]);
        let (_, lineage) = configure(&s, 1024, DAY, DAY + 3_000);
        assert_eq!(lineage, Lineage::default());
    }

    #[test]
    fn going_back_to_an_earlier_capacity_reuses_its_records() {
        let s = Shared::default();
        let (a, _) = configure(&s, 64, DAY, 0);
        let h = match a.claim(&s, &d(1), &d(9), 1, 0, 60_000, || {}).unwrap() {
            Claim::Claimed(h) => h,
            other => panic!("{other:?}"),
        };
        a.complete(&s, &h, &response(), 1, DAY, RecordWithoutIt)
            .unwrap();
        configure(&s, 1024, DAY, 10);
        let (a_again, lineage) = configure(&s, 64, DAY, 20);
        assert_eq!(lineage.retired.len(), 1);
        assert_eq!(lineage.retired[0].layout.buckets, 128);
        assert!(matches!(
            a_again
                .claim(&s, &d(1), &d(9), 2, 30, 60_000, || {})
                .unwrap(),
            Claim::Completed { .. }
        ));
    }

    #[test]
    fn registry_text_round_trips_and_garbage_reads_as_empty() {
        let entries = vec![
            TableEntry {
                layout: layout(16_384),
                record_life_ms: DAY,
                retired_at_ms: None,
            },
            TableEntry {
                layout: layout(64),
                record_life_ms: 5,
                retired_at_ms: Some(77),
            },
        ];
        assert_eq!(decode(&encode(&entries)), entries);
        assert_eq!(decode(b"\xff\xfe junk"), vec![]);
        assert_eq!(decode(b"1 2"), vec![]);
    }
}

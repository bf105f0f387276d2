//! Keeping the local table in step with the tables other configurations of this process use:
//! registering it, consulting the tables a capacity change retired, and emptying those whose
//! records have all expired, a few buckets per tick (see core's `table::lineage`).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;

use crate::host::Host;
use crate::table::lineage::{self, Lineage, LineageWatch, TableEntry};
use crate::table::Table;

/// Buckets emptied per tick: each is nine shared-data writes under Envoy's process-wide lock,
/// so a tick stays well under a millisecond however large the retired table.
const BUCKETS_PER_TICK: u32 = 64;

pub struct TableUpkeep {
    namespace: String,
    /// The process's bucket salt (emptying does not depend on it; building a table does).
    salt: u64,
    watch: LineageWatch,
    /// When the next retired table's records have all expired and it can be emptied.
    next_reclaim_ms: Cell<Option<u64>>,
    /// Tables being emptied, with the next bucket to empty.
    emptying: RefCell<VecDeque<(Table, u32)>>,
}

impl TableUpkeep {
    /// Upkeep that registers nothing, for a configuration that never claims (the replay
    /// echo): the tables of filters sharing its `vm_id` stay as they are.
    pub fn idle(namespace: &str, table: &Table, max_record_life_ms: u64) -> TableUpkeep {
        TableUpkeep {
            namespace: namespace.to_string(),
            salt: table.salt(),
            watch: LineageWatch::new(namespace, max_record_life_ms),
            next_reclaim_ms: Cell::new(None),
            emptying: RefCell::new(VecDeque::new()),
        }
    }

    /// Registers `table` (at configure). Failures only cost the old records, never the
    /// configuration.
    pub fn adopt(
        host: &impl Host,
        namespace: &str,
        table: &Table,
        max_record_life_ms: u64,
    ) -> TableUpkeep {
        let upkeep = TableUpkeep::idle(namespace, table, max_record_life_ms);
        match upkeep.watch.adopt(host, table, host.now_ms()) {
            Ok(lineage) => {
                for old in &lineage.retired {
                    log::warn!(
                        "local_table changed: the earlier table {} is still consulted and its \
                         memory held until its records expire ({} ms from its retirement)",
                        old.layout.tag(),
                        old.record_life_ms
                    );
                }
                upkeep.follow(lineage);
            }
            Err(e) => log::warn!(
                "table registry unavailable ({}); earlier tables are not consulted",
                e.0
            ),
        }
        upkeep
    }

    /// Before claiming a key the table lacks: catch up with a registry another configuration
    /// changed (a push that brought this configuration back without configuring it again).
    pub fn before_new_claim(&self, host: &impl Host, table: &Table, now_ms: u64) {
        match self.watch.refresh(host, table, now_ms) {
            Ok(None) => {}
            Ok(Some(lineage)) => self.follow(lineage),
            Err(e) => log::debug!("table registry unreadable: {}", e.0),
        }
    }

    /// On the root's tick: take expired retired tables off the registry, and empty a few
    /// buckets of the ones being emptied.
    pub fn on_tick(&self, host: &impl Host) {
        let now_ms = host.now_ms();
        if self.next_reclaim_ms.get().is_some_and(|at| now_ms >= at) {
            self.next_reclaim_ms.set(None);
            match lineage::reclaim_due(host, &self.namespace, now_ms) {
                Ok(due) => self.start_emptying(&due),
                Err(e) => log::warn!("retired tables not reclaimed: {}", e.0),
            }
        }
        let mut emptying = self.emptying.borrow_mut();
        let Some((table, first)) = emptying.front_mut() else {
            return;
        };
        match table.empty_buckets(host, *first, BUCKETS_PER_TICK) {
            Ok(Some(next)) => *first = next,
            Ok(None) => {
                log::info!(
                    "emptied the retired local table {}: its records had expired",
                    table.layout().tag()
                );
                emptying.pop_front();
            }
            Err(e) => {
                log::warn!(
                    "retired table {} not emptied: {}",
                    table.layout().tag(),
                    e.0
                );
                emptying.pop_front();
            }
        }
    }

    fn follow(&self, lineage: Lineage) {
        self.start_emptying(&lineage.to_reclaim);
        let next = lineage
            .retired
            .iter()
            .filter_map(TableEntry::reclaimable_at_ms)
            .min();
        self.next_reclaim_ms.set(next);
    }

    fn start_emptying(&self, tables: &[TableEntry]) {
        let mut emptying = self.emptying.borrow_mut();
        for old in tables {
            let table = Table::new(&self.namespace, old.layout.clone(), self.salt);
            emptying.push_back((table, 0));
        }
    }
}

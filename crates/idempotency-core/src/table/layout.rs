//! How the local table spends its byte budget (`local_table.max_bytes`): a fixed number of
//! slots, each with a small response of its own, and for larger responses a few rings of
//! pages in size classes. Every key the table writes is counted here at its largest, so the
//! table's share of Envoy's memory is bounded by construction, whatever the traffic: nothing
//! grows with the number of keys, and a response that fits no page is recorded without its
//! body.
//!
//! Half the budget goes to the slots (their metadata and each slot's inline response), the
//! other half to the page rings, split evenly between the size classes. A page ring is
//! overwritten oldest first: under pressure large bodies are kept for less time, never
//! refused and never beyond the budget.

/// Slots per bucket. Each claim copies one bucket (8 × 91 bytes); a new key evicts the
/// oldest completed record of its bucket, so more ways make eviction closer to oldest-first
/// across the table, and a burst of in-flight claims less likely to fill a bucket.
pub const WAYS: usize = 8;
pub const SLOT_BYTES: usize = 1 + 32 + 32 + 8 + 8 + 8 + 2;

/// What one shared-data entry costs the host beyond its value: the map node, the key text
/// and allocation rounding. Measured on Envoy 1.40 by the benchmarks' memory run (about 488
/// bytes per entry the table added; see docs/benchmarks.md), rounded up.
pub const ENTRY_OVERHEAD_BYTES: u64 = 512;
/// A slot's fixed cost: its share of the bucket entry, and its response entry.
pub const SLOT_FIXED_BYTES: u64 =
    SLOT_BYTES as u64 + ENTRY_OVERHEAD_BYTES / WAYS as u64 + ENTRY_OVERHEAD_BYTES;
/// Inline responses are never larger than this (a bigger one is a page's job).
pub const MAX_INLINE_BYTES: u64 = 4_096;
/// The least a slot may keep inline: a typical JSON answer to a write, with its headers.
pub const MIN_INLINE_BYTES: u64 = 512;
/// The smallest page; each next class is `PAGE_GROWTH` times larger.
pub const FIRST_PAGE_BYTES: u64 = 16 * 1024;
pub const PAGE_GROWTH: u64 = 8;
/// Room for a recorded response's headers on top of its body (Envoy's default limit on
/// response headers is 60 KiB).
pub const HEADER_ALLOWANCE_BYTES: u64 = 64 * 1024;
/// Bytes of budget per slot when the capacity is derived from the budget.
pub const BUDGET_PER_DERIVED_SLOT: u64 = 4_096;
pub const MAX_SLOTS: u64 = 4_000_000;
/// A page starts with the sequence number it was written under.
pub const PAGE_HEADER_BYTES: usize = 8;
/// The few entries beside slots and pages, counted at their largest: the bucket salt, the
/// registry of tables (at most five short lines) and the owner-token counter.
pub const FIXED_ENTRIES_BYTES: u64 = 3 * (ENTRY_OVERHEAD_BYTES + 512);
/// Each page class's cursor (the next sequence number).
pub const CURSOR_BYTES: u64 = 8 + ENTRY_OVERHEAD_BYTES;

/// One ring of pages of one size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageClass {
    /// Largest value a page holds (its header included).
    pub page_bytes: u32,
    pub pages: u32,
}

/// The table's geometry; its text form names the table's keys, so a different layout is a
/// different table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub buckets: u32,
    /// Largest encoded response a slot keeps under its own key.
    pub inline_bytes: u32,
    /// Smallest first; a response goes to the first class its encoding fits.
    pub classes: Vec<PageClass>,
}

/// Why a budget cannot be laid out, naming the setting to change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutError {
    pub field: &'static str,
    pub reason: String,
}

impl Layout {
    /// Lays out `max_bytes` for `capacity` slots (derived from the budget when None), with
    /// pages up to the largest response a rule records (`largest_body` plus headers).
    pub fn plan(
        max_bytes: u64,
        capacity: Option<u64>,
        largest_body: u64,
    ) -> Result<Layout, LayoutError> {
        let slots = capacity
            .unwrap_or(max_bytes / BUDGET_PER_DERIVED_SLOT)
            .clamp(WAYS as u64, MAX_SLOTS);
        let buckets = slots.div_ceil(WAYS as u64);
        let slots = buckets * WAYS as u64;
        let per_slot = (max_bytes / 2) / slots;
        let needed = SLOT_FIXED_BYTES + MIN_INLINE_BYTES;
        if per_slot < needed {
            return Err(LayoutError {
                field: "local_table.capacity",
                reason: format!(
                    "{slots} slots need at least {} bytes of local_table.max_bytes ({needed} per \
                     slot, twice over: half of the budget is for larger responses); lower the \
                     capacity to at most {} or raise max_bytes",
                    slots * needed * 2,
                    (max_bytes / 2 / needed / WAYS as u64) * WAYS as u64
                ),
            });
        }
        let inline_bytes = (per_slot - SLOT_FIXED_BYTES).min(MAX_INLINE_BYTES);
        let sizes = page_sizes(largest_body.saturating_add(HEADER_ALLOWANCE_BYTES));
        let spill = max_bytes
            .saturating_sub(slots * (SLOT_FIXED_BYTES + inline_bytes))
            .saturating_sub(FIXED_ENTRIES_BYTES)
            .saturating_sub(sizes.len() as u64 * CURSOR_BYTES);
        let share = spill / sizes.len().max(1) as u64;
        let classes = sizes
            .into_iter()
            .filter(|&page| page > inline_bytes)
            .filter_map(|page| {
                let pages = share / (page + ENTRY_OVERHEAD_BYTES);
                Some(PageClass {
                    page_bytes: u32::try_from(page).ok()?,
                    pages: u32::try_from(pages).ok().filter(|&n| n > 0)?,
                })
            })
            .collect();
        Ok(Layout {
            buckets: u32::try_from(buckets).map_err(|_| LayoutError {
                field: "local_table.capacity",
                reason: "too large".to_string(),
            })?,
            inline_bytes: inline_bytes as u32,
            classes,
        })
    }

    pub fn slots(&self) -> u64 {
        u64::from(self.buckets) * WAYS as u64
    }

    /// The most the table's keys and values can hold in the host, overheads included.
    pub fn bound_bytes(&self) -> u64 {
        let slots = self.slots() * (SLOT_FIXED_BYTES + u64::from(self.inline_bytes));
        let pages: u64 = self
            .classes
            .iter()
            .map(|c| {
                u64::from(c.pages) * (u64::from(c.page_bytes) + ENTRY_OVERHEAD_BYTES) + CURSOR_BYTES
            })
            .sum();
        slots + pages + FIXED_ENTRIES_BYTES
    }

    /// The page class for an encoded response of `len` bytes; None when it fits none.
    pub fn class_for(&self, len: usize) -> Option<u8> {
        let len = len.saturating_add(PAGE_HEADER_BYTES);
        self.classes
            .iter()
            .position(|c| len <= c.page_bytes as usize)
            .and_then(|i| u8::try_from(i).ok())
    }

    /// Text form: `2048x8i1669p16384x658p131072x81p1114112x10`.
    pub fn tag(&self) -> String {
        let mut tag = format!("{}x{WAYS}i{}", self.buckets, self.inline_bytes);
        for c in &self.classes {
            tag.push_str(&format!("p{}x{}", c.page_bytes, c.pages));
        }
        tag
    }

    /// Reads `tag()` back; None for anything else.
    pub fn parse(tag: &str) -> Option<Layout> {
        let (head, rest) = tag.split_once('i')?;
        let (buckets, ways) = head.split_once('x')?;
        if ways.parse::<usize>().ok()? != WAYS {
            return None;
        }
        let mut parts = rest.split('p');
        let inline_bytes = parts.next()?.parse().ok()?;
        let classes = parts
            .map(|class| {
                let (page, pages) = class.split_once('x')?;
                Some(PageClass {
                    page_bytes: page.parse().ok()?,
                    pages: pages.parse().ok()?,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Layout {
            buckets: buckets.parse().ok()?,
            inline_bytes,
            classes,
        })
    }
}

/// Page sizes from `FIRST_PAGE_BYTES` growing by `PAGE_GROWTH`, the last one exactly `largest`.
fn page_sizes(largest: u64) -> Vec<u64> {
    let mut sizes = Vec::new();
    let mut page = FIRST_PAGE_BYTES;
    // A class within a factor of two of the largest would hold nearly the same responses.
    while page.saturating_mul(2) <= largest {
        sizes.push(page);
        page = page.saturating_mul(PAGE_GROWTH);
    }
    sizes.push(largest.max(FIRST_PAGE_BYTES));
    sizes
}

#[cfg(test)]
mod tests {
    use super::*;
    #[cfg(target_arch = "wasm32")]
    use wasm_bindgen_test::wasm_bindgen_test as test;

    const MIB: u64 = 1024 * 1024;

    #[test]
    fn the_default_budget_holds_sixteen_thousand_slots_and_pages_up_to_a_megabyte() {
        let layout = Layout::plan(64 * MIB, None, MIB).unwrap();
        assert_eq!(layout.slots(), 16_384);
        assert!(layout.inline_bytes >= 1_300, "{layout:?}");
        let pages: Vec<u32> = layout.classes.iter().map(|c| c.page_bytes).collect();
        assert_eq!(
            pages,
            vec![16_384, 131_072, (MIB + HEADER_ALLOWANCE_BYTES) as u32]
        );
        assert!(layout.classes.iter().all(|c| c.pages >= 8), "{layout:?}");
        assert!(layout.bound_bytes() <= 64 * MIB);
        assert!(
            layout.bound_bytes() > 60 * MIB,
            "most of the budget is used"
        );
    }

    #[test]
    fn any_budget_and_capacity_that_plan_stay_within_the_budget() {
        for max_bytes in [MIB, 3 * MIB, 64 * MIB, 1_000 * MIB] {
            for capacity in [None, Some(1), Some(64), Some(1_000), Some(16_384)] {
                for largest in [0, 1_000, MIB, 64 * MIB] {
                    if let Ok(layout) = Layout::plan(max_bytes, capacity, largest) {
                        assert!(
                            layout.bound_bytes() <= max_bytes,
                            "{max_bytes} {capacity:?} {largest}: {layout:?}"
                        );
                        assert!(u64::from(layout.inline_bytes) >= MIN_INLINE_BYTES);
                    }
                }
            }
        }
    }

    #[test]
    fn too_many_slots_for_the_budget_is_refused_with_the_capacity_that_fits() {
        let err = Layout::plan(MIB, Some(16_384), MIB).unwrap_err();
        assert_eq!(err.field, "local_table.capacity");
        let suggested: u64 = err
            .reason
            .split("at most ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap();
        assert!(Layout::plan(MIB, Some(suggested), MIB).is_ok());
        assert!(Layout::plan(MIB, Some(suggested + WAYS as u64), MIB).is_err());
    }

    #[test]
    fn responses_go_to_the_smallest_page_they_fit() {
        let layout = Layout::plan(64 * MIB, None, MIB).unwrap();
        assert_eq!(layout.class_for(10_000), Some(0));
        assert_eq!(layout.class_for(16_384), Some(1), "the page header counts");
        assert_eq!(layout.class_for(MIB as usize), Some(2));
        assert_eq!(layout.class_for(2 * MIB as usize), None);
        // A budget too small for a page of the largest size drops that class.
        let small = Layout::plan(2 * MIB, Some(64), MIB).unwrap();
        assert_eq!(small.class_for(MIB as usize), None);
        assert!(small.class_for(10_000).is_some());
    }

    #[test]
    fn the_tag_reads_back_and_garbage_does_not() {
        let layout = Layout::plan(64 * MIB, None, MIB).unwrap();
        assert_eq!(Layout::parse(&layout.tag()), Some(layout.clone()));
        let no_pages = Layout {
            classes: Vec::new(),
            ..layout
        };
        assert_eq!(Layout::parse(&no_pages.tag()), Some(no_pages));
        for bad in [
            "",
            "2048",
            "2048x4i100",
            "2048x8iabc",
            "2048x8i100p5",
            "x8i1",
        ] {
            assert_eq!(Layout::parse(bad), None, "{bad}");
        }
    }
}

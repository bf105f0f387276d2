//! Prints the local table's layout for one `local_table` setting as JSON, so that the
//! benchmarks and the end-to-end tests read it from the code instead of copying it:
//!
//! ```sh
//! cargo run -q --release -p idempotency-core --example table_geometry -- \
//!     <capacity|auto> [max_bytes] [largest max_response_bytes]
//! ```
//!
//! `max_bytes` and the largest response default to the filter's defaults; key names are in
//! the filter's namespace.
//!
//! Byte counts and key names are observed through the table's public API writing to an
//! in-memory shared data, so they are what the filter writes into Envoy's.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::process::ExitCode;

use idempotency_core::host::{HostError, SetOutcome, SharedData};
use idempotency_core::plugin::NAMESPACE;
use idempotency_core::table::layout::Layout;
use idempotency_core::table::{Claim, Table, WAYS};

/// Shared data with the host's semantics (a write to an absent key always succeeds; an
/// existing key only takes a write carrying its cas, or none), keeping the order of writes.
#[derive(Default)]
struct Recorder {
    entries: RefCell<BTreeMap<String, (Vec<u8>, u32)>>,
    written: RefCell<Vec<String>>,
}

impl SharedData for Recorder {
    fn get(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, HostError> {
        Ok(self.entries.borrow().get(key).cloned())
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<SetOutcome, HostError> {
        let mut entries = self.entries.borrow_mut();
        let next = match (entries.get(key), cas) {
            (Some((_, current)), Some(cas)) if *current != cas => {
                return Ok(SetOutcome::CasMismatch)
            }
            (Some((_, current)), _) => current.wrapping_add(1),
            (None, _) => 1,
        };
        entries.insert(key.to_string(), (value.to_vec(), next));
        self.written.borrow_mut().push(key.to_string());
        Ok(SetOutcome::Stored)
    }
}

fn geometry(layout: Layout) -> Result<serde_json::Value, String> {
    let table = Table::new(NAMESPACE, layout.clone(), 0);
    let buckets = table.bucket_count();
    let shared = Recorder::default();

    // A claim writes its bucket's whole value: its length is what one bucket holds.
    let claimed = table
        .claim(&shared, &[7; 32], &[9; 32], 1, 0, 1_000, || {})
        .map_err(|e| e.to_string())?;
    let Claim::Claimed(_) = claimed else {
        return Err(format!("a claim in an empty table answered {claimed:?}"));
    };
    let bucket_bytes = shared
        .entries
        .borrow()
        .values()
        .map(|(value, _)| value.len())
        .max()
        .unwrap_or(0);
    if bucket_bytes == 0 || bucket_bytes % WAYS != 0 {
        return Err(format!(
            "a bucket of {bucket_bytes} bytes is not {WAYS} equal slots"
        ));
    }

    // Emptying the last bucket writes its key, then the response key of each of its slots:
    // the longest key names the filter gives an entry of this table.
    let shared = Recorder::default();
    table
        .empty_buckets(&shared, buckets.saturating_sub(1), 1)
        .map_err(|HostError(e)| e)?;
    let written = shared.written.into_inner();
    let (bucket_key, response_keys) = written.split_first().ok_or("emptying wrote no key")?;
    let response_key = response_keys
        .iter()
        .max_by_key(|key| key.len())
        .ok_or("emptying wrote no response key")?;

    let classes: Vec<serde_json::Value> = layout
        .classes
        .iter()
        .map(|c| serde_json::json!({"page_bytes": c.page_bytes, "pages": c.pages}))
        .collect();
    Ok(serde_json::json!({
        "capacity": table.capacity(),
        "inline_bytes": layout.inline_bytes,
        "page_classes": classes,
        "bound_bytes": layout.bound_bytes(),
        "buckets": buckets,
        "ways": WAYS,
        "bucket_bytes": bucket_bytes,
        "slot_bytes": bucket_bytes / WAYS,
        "bucket_key": bucket_key,
        "response_key": response_key,
    }))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let number =
        |i: usize, default: u64| args.get(i).map_or(Some(default), |a| a.parse::<u64>().ok());
    let capacity = match args.first().map(String::as_str) {
        Some("auto") => Some(None),
        Some(n) => n.parse::<u64>().ok().map(Some),
        None => None,
    };
    let (Some(capacity), Some(max_bytes), Some(largest)) =
        (capacity, number(1, 64 << 20), number(2, 1 << 20))
    else {
        eprintln!("usage: table_geometry <capacity|auto> [max_bytes] [largest max_response_bytes]");
        return ExitCode::from(2);
    };
    let layout = match Layout::plan(max_bytes, capacity, largest) {
        Ok(layout) => layout,
        Err(e) => {
            eprintln!("table_geometry: {}: {}", e.field, e.reason);
            return ExitCode::FAILURE;
        }
    };
    match geometry(layout) {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("table_geometry: {e}");
            ExitCode::FAILURE
        }
    }
}

//! Prints the local table's geometry for one `local_table.capacity` as JSON, so that the
//! benchmarks and the end-to-end tests read it from the code instead of copying it:
//!
//! ```sh
//! cargo run -q --release -p idempotency-core --example table_geometry -- <capacity> [namespace]
//! ```
//!
//! The namespace defaults to the filter's own.
//!
//! Byte counts and key names are observed through the table's public API writing to an
//! in-memory shared data, so they are what the filter writes into Envoy's.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::process::ExitCode;

use idempotency_core::plugin::NAMESPACE;
use idempotency_core::table::{Claim, HostError, SetOutcome, SharedData, Table, WAYS};

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

fn geometry(capacity: u32, namespace: &str) -> Result<serde_json::Value, String> {
    let table = Table::new(namespace, capacity);
    let buckets = table.bucket_count();
    let shared = Recorder::default();

    // A claim writes its bucket's whole value: its length is what one bucket holds.
    let claimed = table
        .claim(&shared, &[7; 32], &[9; 32], 1, 0, 1_000)
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

    Ok(serde_json::json!({
        "capacity_requested": capacity,
        "capacity": table.capacity(),
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
    let Some(capacity) = args.first().and_then(|a| a.parse::<u32>().ok()) else {
        eprintln!("usage: table_geometry <capacity> [namespace]");
        return ExitCode::from(2);
    };
    // By default the filter's own namespace, so key names have their real length.
    let namespace = args.get(1).map_or(NAMESPACE, String::as_str);
    match geometry(capacity, namespace) {
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

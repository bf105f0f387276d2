//! Replays every committed fuzz input, on stable: each file of `fuzz/corpus/<target>/` and
//! `fuzz/regressions/<target>/` through its check. A target without a corpus fails the test,
//! so the replay can never pass by finding nothing to run.

// Test code: a failed unwrap or expect is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use idempotency_fuzz_checks::TARGETS;

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz")
}

/// The files of `dir`, sorted; None when it does not exist.
fn inputs(dir: &Path) -> Option<Vec<PathBuf>> {
    let entries = fs::read_dir(dir).ok()?;
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.expect("a readable directory entry").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    Some(files)
}

#[test]
fn every_committed_input_passes_its_check() {
    let mut failures = Vec::new();
    for (target, check) in TARGETS {
        let corpus = inputs(&fuzz_dir().join("corpus").join(target)).unwrap_or_default();
        assert!(
            !corpus.is_empty(),
            "fuzz/corpus/{target}/ is missing or empty: run `make fuzz` and commit it"
        );
        let regressions = inputs(&fuzz_dir().join("regressions").join(target)).unwrap_or_default();
        println!(
            "{target:<22} {:>5} corpus files, {:>3} regressions",
            corpus.len(),
            regressions.len()
        );
        for file in corpus.iter().chain(&regressions) {
            let bytes = fs::read(file).expect("a readable input");
            if catch_unwind(AssertUnwindSafe(|| check(&bytes))).is_err() {
                failures.push(file.display().to_string());
            }
        }
    }
    assert!(
        failures.is_empty(),
        "inputs that fail their check: {failures:#?}"
    );
}

#[test]
fn every_corpus_directory_is_a_known_target() {
    for kind in ["corpus", "regressions"] {
        let Ok(entries) = fs::read_dir(fuzz_dir().join(kind)) else {
            continue;
        };
        for entry in entries {
            let name = entry.expect("a readable directory entry").file_name();
            let name = name.to_string_lossy();
            assert!(
                TARGETS.iter().any(|(t, _)| *t == name),
                "fuzz/{kind}/{name} names no target of idempotency_fuzz_checks::TARGETS"
            );
        }
    }
    let targets_dir = fuzz_dir().join("fuzz_targets");
    for (target, _) in TARGETS {
        assert!(
            targets_dir.join(format!("{target}.rs")).is_file(),
            "fuzz/fuzz_targets/{target}.rs is missing"
        );
    }
}

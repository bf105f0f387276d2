#!/usr/bin/env bash
# Runs every cargo-fuzz target of fuzz/ for a bounded time and fails on any crash.
#   scripts/fuzz.sh            each target for FUZZ_SECONDS (default 20), then a summary table
#   scripts/fuzz.sh --cmin     minimizes each target's corpus in place (before committing it)
# FUZZ_TARGETS="a b" limits either to some targets. New inputs land in fuzz/corpus/<target>/;
# a crash is written to fuzz/artifacts/<target>/ (ignored by git): minimize it
# (`cargo +nightly fuzz tmin <target> <file>`) and commit it under fuzz/regressions/<target>/,
# which `make test` replays (crates/fuzz-checks/tests/corpus.rs).
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

seconds=${FUZZ_SECONDS:-20}
# The code under test is safe Rust: AddressSanitizer would mostly halve the executions.
# Overflow checks and debug assertions stay on (cargo-fuzz's default).
build_flags=(--sanitizer none)

targets=${FUZZ_TARGETS:-$(cargo +nightly fuzz list)}

if [[ ${1:-} == --cmin ]]; then
    for t in $targets; do
        before=$(find "corpus/$t" -type f | wc -l)
        # Edges only, not hit counts: the committed corpus stays a few hundred files.
        cargo +nightly fuzz cmin "${build_flags[@]}" "$t" "corpus/$t" -- -use_counters=0 \
            >"/tmp/fuzz-cmin-$t.log" 2>&1 ||
            { tail -20 "/tmp/fuzz-cmin-$t.log"; exit 1; }
        echo "$t: $before -> $(find "corpus/$t" -type f | wc -l) corpus files"
    done
    exit 0
fi

# Built once up front, so each target's time is spent fuzzing.
cargo +nightly fuzz build "${build_flags[@]}"

declare -A runs status
failed=()
for t in $targets; do
    mkdir -p "corpus/$t" "regressions/$t" "artifacts/$t"
    log="artifacts/$t/last-run.log"
    echo "fuzzing $t for ${seconds}s"
    # -timeout: an input that hangs for 10 s is a failure too. The outer timeout only guards
    # against libFuzzer itself not stopping.
    if timeout $((seconds * 2 + 120)) cargo +nightly fuzz run "${build_flags[@]}" "$t" \
        "corpus/$t" "regressions/$t" -- \
        -max_total_time="$seconds" -timeout=10 -artifact_prefix="artifacts/$t/" \
        -print_final_stats=1 >"$log" 2>&1; then
        status[$t]=ok
    else
        status[$t]=FAILED
        failed+=("$t")
        # A crash names its input; anything else (a build that failed) shows its end.
        grep -E "panicked at|^SUMMARY|Test unit written" "$log" | head -5 || tail -20 "$log"
    fi
    runs[$t]=$(grep -oE '^Done [0-9]+ runs' "$log" | tail -1 | awk '{print $2}' || true)
done

printf '\n%-22s %12s %8s  %s\n' target executions corpus result
for t in $targets; do
    printf '%-22s %12s %8s  %s\n' "$t" "${runs[$t]:-?}" "$(find "corpus/$t" -type f | wc -l)" "${status[$t]}"
done
if ((${#failed[@]})); then
    echo "crashes in: ${failed[*]} (inputs and logs under fuzz/artifacts/)"
    exit 1
fi

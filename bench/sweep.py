"""Claims while the embedded store sweeps: what an expiry sweep costs the claims that arrive
during it. The store (`--sweep-interval-secs 1`) is filled over its stream with claims whose
lease ends a few seconds later; new claims are then measured twice, the same way
(`stream_load`, as the store-alone section): once before any of the filled records has
expired (nothing to sweep), once while the sweeper deletes them, chunk by chunk, between the
claims' commits.
"""

from __future__ import annotations

import re
import time
import subprocess
from dataclasses import dataclass
from pathlib import Path

import harness
from measure import WRK_CONNECTIONS, BenchFailure, WrkResult, log, stream_load_argv, stream_load_result
from setups import STORE_TOKEN

# The filled claims' lease: long enough for the quiet run to end before any expires.
FILL_LEASE_MS = 20_000
FILL_SECONDS = 8.0
MEASURE_SECONDS = 6.0


@dataclass
class SweepResult:
    filled: int
    quiet: WrkResult
    sweeping: WrkResult
    swept_during: int


def _load(store: harness.Store, seconds: float, lease_ms: int | None = None) -> WrkResult:
    argv = stream_load_argv(store.base_url, WRK_CONNECTIONS, seconds)
    if lease_ms is not None:
        argv += ["--lease-ms", str(lease_ms)]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60, preexec_fn=harness._preexec())
    return stream_load_result("embedded", argv, res)


def _swept(log_text: str) -> int:
    """Records the sweeper reported deleting in `log_text` (its debug line per sweep)."""
    total = 0
    for line in log_text.splitlines():
        found = re.search(r"removed=(\d+)", line)
        if found and "swept expired records" in line:
            total += int(found.group(1))
    return total


def run_sweep(tmp: Path) -> SweepResult:
    with harness.ProcessGroup(tmp) as group:
        store = group.add(harness.Store(tmp, token=STORE_TOKEN, backend="embedded", name="store-sweep",
                                        log_level="warn,idempotency_store::sweeper=debug",
                                        extra_args=["--sweep-interval-secs", "1"]).start())
        started = time.monotonic()
        fill = _load(store, FILL_SECONDS, FILL_LEASE_MS)
        if fill.requests < 1000:
            raise BenchFailure(f"sweep run: only {fill.requests} claims filled the store")
        log(f"sweep run: filled {fill.requests:,} claims expiring {FILL_LEASE_MS / 1000:.0f} s after each")
        quiet = _load(store, MEASURE_SECONDS)
        log(f"  claims, nothing to sweep: p50 {quiet.p50_ms:.2f} ms, p99 {quiet.p99_ms:.2f} ms")
        # Until the first filled records expire and the sweeper (every second) takes them.
        wait = started + FILL_LEASE_MS / 1000 + 1.5 - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        logged = len(store.process.log_text())
        sweeping = _load(store, MEASURE_SECONDS)
        swept = _swept(store.process.log_text()[logged:])
        log(f"  claims while the sweeper deletes: p50 {sweeping.p50_ms:.2f} ms, p99 {sweeping.p99_ms:.2f} ms "
            f"({swept:,} records swept meanwhile)")
    return SweepResult(fill.requests, quiet, sweeping, swept)


def report(add, r: SweepResult | None) -> list[tuple[str, bool | None, str]]:
    add("## Claims during an expiry sweep")
    add("")
    if r is None:
        add("Not run.")
        add("")
        return []
    add(f"The embedded store swept every second (`--sweep-interval-secs 1`), filled over its stream with "
        f"{r.filled:,} claims expiring {FILL_LEASE_MS / 1000:.0f} s after each ({FILL_SECONDS:.0f} s of "
        f"`stream_load`), then new claims measured for {MEASURE_SECONDS:.0f} s each, {WRK_CONNECTIONS} in flight "
        "on one stream: before any filled record expired, and again while the sweeper deleted them "
        f"(the sweeper reported {r.swept_during:,} records deleted in the sweeps that ended during that run). A sweep "
        "deletes in chunks of at most 128 records or 4 ms, each its own transaction, so claims' commits go "
        "in between.")
    add("")
    add("| run | claims/s | p50 ms | p99 ms |")
    add("| --- | ---: | ---: | ---: |")
    for name, w in (("nothing to sweep", r.quiet), ("while the sweeper deletes", r.sweeping)):
        add(f"| {name} | {w.rps:,.0f} | {w.p50_ms:.2f} | {w.p99_ms:.2f} |")
    add("")
    ratio = r.sweeping.p99_ms / r.quiet.p99_ms if r.quiet.p99_ms > 0 else float("inf")
    return [("a claim's p99 during an expiry sweep ≤ 2× its p99 without one (embedded store)", ratio <= 2.0,
             f"{r.sweeping.p99_ms:.2f} vs {r.quiet.p99_ms:.2f} ms = {ratio:.2f}×")]

#!/usr/bin/env python3
"""The chaos soak (issue 11, part 3): `make soak`, or `.venv/bin/python tests/soak/soak.py`.

Two Envoys (two workers each) share two stores, one embedded and one on Redis, in front of
the demo upstream (see topology.py). Bounded worker threads send mixed traffic (traffic.py)
while the main thread injects faults one at a time (faults.py). Then the traffic stops, the
system settles for a lease and more, every key gets a final answer through each Envoy, and
the audit (audit.py) checks each key against the upstream's execution count, every answer
against what the docs allow at that moment, the Envoys' VM health and logs, and memory.
It prints a tally, writes it (and the whole ledger) into the run directory, and exits 1 on
any failure.

The traffic phase lasts ``--seconds`` (default $SOAK_SECONDS or 300); the whole run, set-up
and audit included, ends within that plus 90 s: every phase has a deadline, and a watchdog
stops everything should one be missed. Everything runs on 127.0.0.1 with free ports, and
every process is stopped by its PID at the end, on an error, or on Ctrl-C.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "e2e"))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from audit import Audit  # noqa: E402
from faults import EnvoyBook, FaultScheduler  # noqa: E402
from helpers import crash_lines, new_key, post, unique_path  # noqa: E402
from ledger import Clock, FaultLog, Ledger  # noqa: E402
from topology import (  # noqa: E402
    KIB,
    LEASE_SECONDS,
    MIB,
    RULES,
    Topology,
    envoy_rss_allowance_kib,
    start_topology,
)
from traffic import Traffic  # noqa: E402

# Beyond --seconds: set-up (~15 s), the workers' last scenarios, the settling lease, the
# final round, counting and the audit.
WALL_ALLOWANCE_SECONDS = 90
# Kept for the tail of the run: counting executions, the audit, stopping every process.
AUDIT_RESERVE_SECONDS = 20
WORKERS = 8
# The store processes hold no per-key memory beyond caches (the embedded store's redb cache,
# the Redis client's buffers), and Redis holds the records themselves: the soak's whole data
# set (a few thousand records, a few percent with bodies of 64 KiB to 1 MiB) stays far below
# this. More would mean memory that grows with traffic and is never given back.
STORE_RSS_BOUND_KIB = 256 * MIB // KIB
WARMUP_RESPONSE_BYTES = 1_000_000
# Envoy log lines worth a count in the tally (the filter's own warnings about the store).
LOG_MARKERS = {
    "completion refused by the store (another request took the key over)": "the store keeps that request's response",
    "completion refused by the store (bad request)": "store Complete refused",
    "completion given up": "store Complete given up",
    "release given up": "store Release given up",
    "lease takeovers": "took over a claim whose lease had passed",
    "late responses not recorded": "response not recorded",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS") or 300),
                        help="length of the traffic phase (default $SOAK_SECONDS or 300)")
    parser.add_argument("--seed", type=int, default=int(os.environ.get("SOAK_SEED") or time.time()) % 100_000,
                        help="seeds every worker's choices (printed, to replay a run's mix)")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="logs, configs, data and the tally (default: a new temporary directory)")
    parser.add_argument("--workers", type=int, default=WORKERS)
    args = parser.parse_args(argv)
    if args.seconds < 30:
        parser.error("--seconds must be at least 30 (one fault of each kind needs about 50)")
    return args


def start_watchdog(deadline: float) -> None:
    """The last resort behind every phase's own deadline: stop everything by PID and exit."""
    def watch() -> None:
        while time.monotonic() < deadline:
            time.sleep(1.0)
        print(f"\nSOAK: the hard deadline passed; stopping every process", flush=True)
        harness.stop_all_processes()
        os._exit(3)
    threading.Thread(target=watch, name="watchdog", daemon=True).start()


class RssMonitor:
    """Samples every long-lived process's RSS twice a second; keeps each one's peak."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.peaks: dict[str, int] = {}
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)

    def start(self, deadline: float) -> None:
        self._deadline = deadline
        self._thread.start()

    def sample(self) -> None:
        for name, proc in self.topology.processes().items():
            pid = proc.pid
            if pid is None or not proc.alive():
                continue
            try:
                rss = harness.rss_kib(pid)
            except (OSError, RuntimeError):
                continue  # exited between the check and the read
            self.peaks[name] = max(self.peaks.get(name, 0), rss)

    def _run(self) -> None:
        while not self.stop.wait(0.5) and time.monotonic() < self._deadline:
            self.sample()

    def finish(self) -> None:
        self.stop.set()
        self._thread.join(timeout=5)


def smoke(traffic: Traffic) -> None:
    """One write per rule through one Envoy, replayed through the other: the set-up works."""
    a, b = traffic.topology.envoys
    for rule in RULES.values():
        record = traffic.new_record("smoke", rule)
        first = traffic.send(record, a, "smoke")
        if first.status != 201 or first.replayed:
            raise RuntimeError(f"smoke write on rule {rule.name} failed: {first.describe()}")
        deadline = time.monotonic() + 10
        for _ in range(50):
            replay = traffic.send(record, b, "smoke")
            if replay.status != 409 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if not replay.replayed:
            raise RuntimeError(f"smoke replay on rule {rule.name} failed: {replay.describe()}")


def warm_up(topology: Topology) -> list[str]:
    """1 MB answers on a path no rule covers (as test_local_budget does), so the RSS baseline
    holds Envoy's buffers and allocator caches and the growth is the table's and the
    filter's. Returns the paths used (they count in the upstream's total)."""
    paths = []
    for envoy in topology.envoys:
        for _ in range(20):
            path = unique_path("unprotected")
            resp = post(envoy, path, key=new_key(), headers={"x-demo-body-bytes": str(WARMUP_RESPONSE_BYTES)})
            if resp.status_code != 201:
                raise RuntimeError(f"warm-up through {envoy.name} answered {resp.status_code}")
            paths.append(path)
    time.sleep(0.5)
    return paths


def count_executions(topology: Topology, paths: list[str]) -> dict[str, int]:
    with ThreadPoolExecutor(max_workers=8) as pool:
        return dict(zip(paths, pool.map(topology.upstream.executions, paths)))


def summed_counters(snapshots: list[dict]) -> dict[str, dict[str, int]]:
    total: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for snap in snapshots:
        for rule, counters in snap.get("rule_counters", {}).items():
            total[rule].update(counters)
    return {rule: dict(sorted(c.items())) for rule, c in sorted(total.items())}


def build_tally(args, run_dir: Path, ledger: Ledger, faults: FaultLog, audit: Audit,
                executions: dict[str, int], upstream_total: int, warmup_paths: list[str],
                book_entries: list[dict], logs: dict[str, list[str]], log_counts: dict[str, int],
                rss: dict[str, dict],
                harness_errors: list[str], wall_seconds: float) -> dict:
    records = ledger.all()
    attempts = [a for r in records for a in r.attempts]
    valid = [v for v in audit.verdicts if not v.record.refused_by_design]
    counted = sum(executions.get(r.path, 0) for r in records) + sum(executions.get(p, 0) for p in warmup_paths)
    failures: list[str] = []
    for v in audit.failures():
        failures.append(f"key {v.record.id} ({v.record.kind}, {v.record.path}): "
                        + " | ".join(f"{category}: {detail}" for category, detail in v.problems[:3]))
    if counted != upstream_total:
        failures.append(f"the upstream executed {upstream_total} requests, the soak's paths account for {counted}")
    vm_failures = {f"{e['envoy']} pid {e['pid']}": e.get("vm_failures", e.get("error")) for e in book_entries}
    for name, value in vm_failures.items():
        if value:
            failures.append(f"{name}: wasm VM failures {value}")
    for name, lines in logs.items():
        if lines:
            failures.append(f"{name} logged {len(lines)} crash line(s), first: {lines[0][:200]}")
    for name, entry in rss.items():
        if entry["bound_kib"] is not None and entry["peak_kib"] > entry["bound_kib"]:
            failures.append(f"{name} RSS {entry['peak_kib']} KiB over its bound {entry['bound_kib']} KiB")
    failures += [f"harness error: {e.splitlines()[-1]}" for e in harness_errors]
    extra_by_cause = audit.duplicate_causes()
    executions_per_key = collections.Counter(min(v.executions, 3) for v in valid)
    return {
        "run": {"seconds": args.seconds, "seed": args.seed, "workers": args.workers,
                "build": harness.FILTER_BUILD,
                "run_dir": str(run_dir), "wall_seconds": round(wall_seconds, 1)},
        "requests_by_kind": dict(collections.Counter(a.kind for a in attempts).most_common()),
        "requests": len(attempts),
        "keys": {
            "total": len(records),
            "protected": len(valid),
            "refused_by_design": len(records) - len(valid),
            "by_scenario": dict(collections.Counter(r.kind for r in records).most_common()),
            "by_rule": dict(collections.Counter(r.rule.name for r in records).most_common()),
        },
        "answers_by_status": dict(sorted(collections.Counter(
            str(a.status) if a.answered else "none" for a in attempts).items())),
        "answers_by_class": dict(audit.answer_classes.most_common()),
        "replays": sum(1 for a in attempts if a.replayed),
        "replays_without_body": sum(1 for a in attempts if a.replayed and a.body_omitted),
        "faults": dict(collections.Counter(f"{f.kind} {f.target}" for f in faults.all())),
        "fault_log": [asdict(f) for f in faults.all()],
        "executions": {
            "upstream_total": upstream_total,
            "of_protected_keys": sum(v.executions for v in valid),
            "protected_keys_by_executions": {("3+" if n == 3 else str(n)): c
                                             for n, c in sorted(executions_per_key.items())},
        },
        "duplicate_executions_by_cause": dict(extra_by_cause.most_common()),
        "unknown_outcomes": audit.unknown_outcomes(),
        "keys_executed_more_than_once": sum(1 for v in valid if v.executions > 1),
        "unexplained_duplicates": [v.record.id for v in audit.unexplained()],
        "fail_open_keys_replaying_each_envoys_own_execution": audit.divergent_fail_open,
        "takeover_keys_replaying_the_late_attempt_before_its_completion_was_refused": audit.superseded_window_replays,
        "failing_keys_by_category": dict(audit.failures_by_category().most_common()),
        "filter_counters": summed_counters(book_entries),
        "envoy_processes": len(book_entries),
        "vm_failures": vm_failures,
        "crash_lines": {name: len(lines) for name, lines in logs.items()},
        "envoy_log_counts": log_counts,
        "rss": rss,
        "failures": failures,
        "harness_errors": harness_errors,
    }


def print_tally(tally: dict, audit: Audit, limit: int = 12) -> None:
    def line(label: str, value) -> None:
        print(f"  {label:<32} {value}")

    print("\n================ soak tally ================")
    run = tally["run"]
    line("traffic seconds / wall seconds", f"{run['seconds']:.0f} / {run['wall_seconds']}")
    line("seed, run directory", f"{run['seed']}, {run['run_dir']}")
    line("filter build", run["build"])
    line("requests", tally["requests"])
    for kind, n in tally["requests_by_kind"].items():
        line(f"  {kind}", n)
    keys = tally["keys"]
    line("keys (protected / refused)", f"{keys['total']} ({keys['protected']} / {keys['refused_by_design']})")
    line("keys by rule", keys["by_rule"])
    line("answers by status", tally["answers_by_status"])
    print("  answers by class:")
    for label, n in tally["answers_by_class"].items():
        line(f"  {label}", n)
    line("replays (without body)", f"{tally['replays']} ({tally['replays_without_body']})")
    line("faults injected", tally["faults"])
    ex = tally["executions"]
    line("executions (upstream total)", ex["upstream_total"])
    line("protected keys by executions", ex["protected_keys_by_executions"])
    line("extra executions by cause", tally["duplicate_executions_by_cause"] or "none")
    line("unexplained duplicates", len(tally["unexplained_duplicates"]))
    line("unknown outcomes", tally["unknown_outcomes"])
    line("fail_open keys, per-Envoy replays", tally["fail_open_keys_replaying_each_envoys_own_execution"])
    line("failing keys by category", tally["failing_keys_by_category"] or "none")
    line("envoy processes / VM failures", f"{tally['envoy_processes']} / "
         f"{sum(1 for v in tally['vm_failures'].values() if v)}")
    line("crash lines in logs", tally["crash_lines"])
    line("Envoy log counts", tally["envoy_log_counts"])
    for rule, counters in tally["filter_counters"].items():
        interesting = {k: v for k, v in counters.items() if v}
        line(f"filter counters {rule}", interesting)
    for name, entry in tally["rss"].items():
        bound = f"{entry['bound_kib'] // 1024} MiB" if entry["bound_kib"] is not None else "reported only"
        base = f", baseline {entry['baseline_kib'] // 1024} MiB" if entry.get("baseline_kib") else ""
        line(f"RSS {name}", f"peak {entry['peak_kib'] // 1024} MiB{base}, bound {bound}")
    failing = audit.failures()
    for verdict in failing[:limit]:
        record = verdict.record
        print(f"\n--- key {record.id} {record.kind} rule={record.rule.name} {record.path} "
              f"executions={verdict.executions}")
        for category, detail in verdict.problems:
            print(f"    ! {category}: {detail}")
        for attempt in record.sorted_attempts():
            print(f"    {attempt.describe()}")
    if len(failing) > limit:
        print(f"\n... and {len(failing) - limit} more failing keys (ledger.jsonl)")
    if tally["failures"]:
        print(f"\nSOAK FAILED: {len(tally['failures'])} failure(s)")
        for failure in tally["failures"][:40]:
            print(f"  - {failure}")
    else:
        print("\nSOAK PASSED")


def write_outputs(run_dir: Path, tally: dict, ledger: Ledger, audit: Audit) -> None:
    (run_dir / "tally.json").write_text(json.dumps(tally, indent=2, default=str))
    verdicts = {v.record.id: v for v in audit.verdicts}
    with open(run_dir / "ledger.jsonl", "w") as out:
        for record in ledger.all():
            entry = record.as_dict()
            verdict = verdicts.get(record.id)
            if verdict is not None:
                entry["executions"] = verdict.executions
                entry["extra_execution_causes"] = [(c, a.sent, why) for c, a, why in verdict.causes]
                entry["problems"] = verdict.problems
            out.write(json.dumps(entry, default=str) + "\n")


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    wall_deadline = started + args.seconds + WALL_ALLOWANCE_SECONDS
    start_watchdog(wall_deadline)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="idempotency-soak-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"soak: {args.seconds:.0f}s of traffic, seed {args.seed}, {args.workers} workers, run dir {run_dir}",
          flush=True)

    with harness.ProcessGroup(run_dir) as procs:
        topology = start_topology(procs)
        clock = Clock()
        ledger, faults, book = Ledger(clock), FaultLog(clock), EnvoyBook()
        traffic = Traffic(topology, clock, ledger, faults, seed=args.seed, workers=args.workers)
        scheduler = FaultScheduler(topology, clock, faults, book, traffic.slow_upstream)
        smoke(traffic)
        warmup_paths = warm_up(topology)
        monitor = RssMonitor(topology)
        monitor.sample()
        baselines = {e.name: monitor.peaks[e.name] for e in topology.envoys}
        monitor.start(wall_deadline)
        print(f"[{clock.now():7.1f}s] set up in {time.monotonic() - started:.1f}s; traffic starts", flush=True)

        traffic_start = clock.now()
        traffic_end = traffic_start + args.seconds
        try:
            traffic.start(until=traffic_end)
            scheduler.run(first_at=traffic_start + 8, until=traffic_end - 8,
                          gap=min(8.0, max(3.0, args.seconds / 40)))
            while clock.now() < traffic_end:
                time.sleep(0.5)
        finally:
            traffic.stop.set()
            scheduler.undo()
        still_running = traffic.join(deadline=traffic_end + 25)
        if still_running:
            traffic.harness_errors.append(f"workers still running after their deadline: {still_running}")
        # Let leases end and queued completions land before the final round.
        while clock.now() < traffic_end + LEASE_SECONDS + 3:
            time.sleep(0.2)
        final_deadline = clock.now() + (wall_deadline - AUDIT_RESERVE_SECONDS - time.monotonic())
        print(f"[{clock.now():7.1f}s] traffic over ({len(ledger.all())} keys); final round until "
              f"{final_deadline:.0f}s", flush=True)
        traffic.settle_every_key(final_deadline)
        print(f"[{clock.now():7.1f}s] final round done; counting executions", flush=True)

        records = ledger.all()
        executions = count_executions(topology, [r.path for r in records] + warmup_paths)
        upstream_total = topology.upstream.total()
        monitor.sample()
        monitor.finish()
        book_entries = book.all(topology.envoys)
        logs = {e.name: crash_lines(e.log_text(), vm_failures=True) for e in topology.envoys}
        log_text = "".join(e.log_text() for e in topology.envoys)
        log_counts = {label: log_text.count(marker) for label, marker in LOG_MARKERS.items()}
        allowance = envoy_rss_allowance_kib()
        rss: dict[str, dict] = {}
        for name, peak in sorted(monitor.peaks.items()):
            entry: dict = {"peak_kib": peak, "bound_kib": None}
            if name in baselines:
                entry.update(baseline_kib=baselines[name], bound_kib=baselines[name] + allowance)
            elif name.startswith("store-") or name == "redis":
                entry["bound_kib"] = STORE_RSS_BOUND_KIB
            rss[name] = entry

        audit = Audit(records, executions, faults.all(), [e.name for e in topology.envoys])
        tally = build_tally(args, run_dir, ledger, faults, audit, executions, upstream_total, warmup_paths,
                            book_entries, logs, log_counts, rss, traffic.harness_errors,
                            time.monotonic() - started)
        write_outputs(run_dir, tally, ledger, audit)
        print_tally(tally, audit)
        for error in traffic.harness_errors[:3]:
            print(f"\nharness error:\n{error}")
    print(f"tally: {run_dir / 'tally.json'}  ledger: {run_dir / 'ledger.jsonl'}  "
          f"(wall {time.monotonic() - started:.0f}s)")
    return 1 if tally["failures"] else 0


def stop_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # the same orderly stop as Ctrl-C: every process by its PID


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\nsoak interrupted; every process was stopped", file=sys.stderr)
        return 130
    except Exception:  # noqa: BLE001 - the processes are stopped by then (ProcessGroup)
        traceback.print_exc()
        return 2


if __name__ == "__main__":
    sys.exit(main())

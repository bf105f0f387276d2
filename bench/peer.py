"""The filter beside a peer: ldclabs/idempotent-proxy, a Rust reverse proxy (axum, reqwest)
that deduplicates on Redis. Same upstream, same wrk load, one worker each; the peer gets a
fresh Redis each round, the filter's store the run's Redis, as its other setups do.

What is compared is what deduplicating a write costs a deployment, all processes counted:
- the peer: its own CPU and its Redis's, per write (it is the proxy, so its proxying is in
  the figure);
- this filter in cluster mode on Redis: Envoy's, the store's and Redis's CPU per write, and
  the same less what Envoy costs without the filter (the proxy the deployment already runs);
and at the fixed moderate rate the p50 and p99 each adds: the peer over wrk straight to the
upstream, the filter over Envoy without it.

The peer is not built by `make bench` (its source is not in this repository, and machines
without GitHub cannot fetch it): `make peer PEER_SRC=<checkout>` builds it into
target/peer/, or PEER_PROXY_BIN names a binary. Without one the section says so.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import harness
from measure import (BODY, WRK_DIR, Durations, RateResult, SetupResult, cpu_seconds, log, run_wrk,
                     wrk_argv, WRK_THREADS)
from setups import REPO

PEER_BIN = REPO / "target" / "peer" / "idempotent-proxy-server"
# The peer's route to the upstream: a path /URL_<NAME> goes to the URL in env URL_<NAME>.
PEER_PATH = "/URL_ORDERS"
# The commit the numbers were taken with (`make peer` checks it out).
PEER_COMMIT = "9f0e316"


def peer_binary() -> Path | None:
    given = os.environ.get("PEER_PROXY_BIN")
    path = Path(given) if given else PEER_BIN
    return path if path.is_file() else None


@dataclass
class PeerRound:
    """One round of the peer: saturating, then at the fixed rate, then wrk straight to the
    upstream at the same rate (what the peer's latency is added to)."""

    rps: float
    cpu_us: float  # the peer's CPU and its Redis's, per write
    peer_cpu_us: float
    redis_cpu_us: float
    non2xx: int
    rate: RateResult
    direct: RateResult


def _rate(url: str, durations: Durations, nonce: str, path: str, cpu_pids: list[int]) -> RateResult:
    per_thread = durations.rate_rps / WRK_THREADS
    argv = wrk_argv(url, durations.rate_seconds, WRK_DIR / "post_rate.lua",
                    ["unique", nonce, BODY, f"{per_thread:g}", path])
    cpu0 = sum(cpu_seconds(p) for p in cpu_pids)
    w = run_wrk(argv, durations.rate_seconds)
    cpu = sum(cpu_seconds(p) for p in cpu_pids) - cpu0
    return RateResult(durations.rate_rps, w, 1e6 * cpu / max(1, w.requests), [], " ".join(argv))


def run_peer_round(tmp: Path, upstream: harness.Upstream, durations: Durations, n: int) -> PeerRound:
    binary = peer_binary()
    assert binary is not None
    tmp.mkdir(parents=True, exist_ok=True)
    with harness.ProcessGroup(tmp) as group:
        redis = group.add(harness.start_redis(tmp, name=f"redis-peer-{n}"))
        port = harness.free_port()
        (tmp / ".env").write_text("")  # the peer refuses to start without one
        env = dict(os.environ) | {
            "SERVER_ADDR": f"{harness.LOOPBACK}:{port}",
            "REDIS_URL": f"{harness.LOOPBACK}:{redis.port}",
            "URL_ORDERS": upstream.url("/orders"),
            "POLL_INTERVAL": "100",
            "REQUEST_TIMEOUT": "30000",
            "LOG_LEVEL": "warn",
            # One worker, as Envoy runs with --concurrency 1.
            "TOKIO_WORKER_THREADS": "1",
        }
        peer = group.process([binary], name=f"peer-{n}", env=env, cwd=tmp)
        harness.wait_for_tcp(port, timeout=20, proc=peer)
        url = f"http://{harness.LOOPBACK}:{port}/"
        nonce = f"peer{n}{int(time.time() * 1000)}"
        if durations.warmup > 0:
            run_wrk(wrk_argv(url, durations.warmup, WRK_DIR / "post.lua", ["unique", "w" + nonce, BODY, PEER_PATH]),
                    durations.warmup)
        pids = [peer.pid, redis.process.pid]
        cpu0 = [cpu_seconds(p) for p in pids]
        w = run_wrk(wrk_argv(url, durations.setup, WRK_DIR / "post.lua", ["unique", nonce, BODY, PEER_PATH]),
                    durations.setup)
        cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0)]
        per = [1e6 * c / max(1, w.requests) for c in cpu]
        time.sleep(1.0)
        rate = _rate(url, durations, "r" + nonce, PEER_PATH, pids)
        direct = _rate(upstream.url("/"), durations, "d" + nonce, "/orders", [])
    r = PeerRound(w.rps, sum(per), per[0], per[1], w.non2xx, rate, direct)
    log(f"  peer round {n}: {w.rps:.0f} req/s, CPU {r.cpu_us:.0f} us/write (peer {per[0]:.0f}, Redis {per[1]:.0f}), "
        f"non-2xx {w.non2xx}; at {durations.rate_rps:.0f} req/s p50 {rate.wrk.p50_ms:.2f} ms, "
        f"p99 {rate.wrk.p99_ms:.2f} ms; straight to the upstream p50 {direct.wrk.p50_ms:.2f} ms, "
        f"p99 {direct.wrk.p99_ms:.2f} ms")
    return r


@dataclass
class PeerComparison:
    rounds: list[PeerRound]
    # This filter's rounds in the same run: cluster mode on Redis, and Envoy without a filter.
    ours: list[SetupResult]
    bare: list[SetupResult]
    # The setup of ``ours``: (f), or (fn) on the native build (bench/run.py --peer-against).
    against: str = "f"


def report(add, cmp: PeerComparison | None, by: dict | None = None) -> list[tuple[str, bool | None, str]]:
    """The page's section; returns the targets it checked. ``by``: the run's main setups by key,
    whose (a), (c) and (g) say where cluster mode's added latency and CPU go."""
    add("## Beside a peer: ldclabs/idempotent-proxy")
    add("")
    k = getattr(cmp, "against", "f") if cmp is not None else "f"
    if cmp is None or not cmp.rounds:
        add("Not measured: no peer binary (`make peer PEER_SRC=<a checkout of "
            f"github.com/ldclabs/idempotent-proxy at {PEER_COMMIT}>`, or PEER_PROXY_BIN).")
        add("")
        return []
    add(f"[ldclabs/idempotent-proxy]({'https://github.com/ldclabs/idempotent-proxy'}) at {PEER_COMMIT}, a Rust "
        "reverse proxy that deduplicates on Redis (SET NX, then the response stored in Redis), against this "
        f"filter in cluster mode on the Redis store (setup ({k}){', the native build' if k == 'fn' else ''}), the same demo upstream, wrk load and body, one "
        "worker each, in rounds taken alternately in one run. CPU per write counts every process the "
        "deduplication needs: the peer and its Redis; Envoy, the store and its Redis. \"Added\" CPU for the "
        "filter is that less Envoy's without the filter ((a) in the same round); the peer is the proxy, so all "
        "of its CPU is what it adds. Added latency at the fixed rate: the peer over wrk straight to the "
        "upstream, the filter over Envoy without it.".replace("(f)", f"({k})"))
    add("")
    add(f"| round | peer + Redis CPU µs/write | ({k}) Envoy + store + Redis µs/write | ({k}) added over (a) | "
        f"peer p50 / p99 added, ms | ({k}) p50 / p99 added, ms |")
    add("| --- | ---: | ---: | ---: | ---: | ---: |")
    ratios_cpu, ratios_p50 = [], []
    for i, (p, f, a) in enumerate(zip(cmp.rounds, cmp.ours, cmp.bare), start=1):
        f_total = f.cpu_us_per_request + (f.coordination_cpu_us or 0.0)
        f_added = f_total - a.cpu_us_per_request
        p50_peer = p.rate.wrk.p50_ms - p.direct.wrk.p50_ms
        p99_peer = p.rate.wrk.p99_ms - p.direct.wrk.p99_ms
        if f.rate and a.rate:
            p50_f = f.rate.wrk.p50_ms - a.rate.wrk.p50_ms
            p99_f = f.rate.wrk.p99_ms - a.rate.wrk.p99_ms
            lat_f = f"{p50_f:+.2f} / {p99_f:+.2f}"
            ratios_p50.append(p50_f / p50_peer if p50_peer > 0 else float("inf"))
        else:
            lat_f = "not run"
        ratios_cpu.append(f_added / p.cpu_us if p.cpu_us > 0 else float("inf"))
        add(f"| {i} | {p.cpu_us:.0f} (peer {p.peer_cpu_us:.0f}, Redis {p.redis_cpu_us:.0f}) | {f_total:.0f} | "
            f"{f_added:+.0f} | {p50_peer:+.2f} / {p99_peer:+.2f} | {lat_f} |")
    add("")
    failed = [(i, p.non2xx) for i, p in enumerate(cmp.rounds, start=1) if p.non2xx]
    if failed:
        add("The peer answered non-2xx in its saturating run: "
            + "; ".join(f"round {i}: {n}" for i, n in failed) + ".")
        add("")
    targets = []
    worst_cpu = max(ratios_cpu)
    what = "native cluster" if k == "fn" else "cluster"
    targets.append((f"({k}) {what} on Redis adds no more CPU per write than the peer", worst_cpu <= 1.0,
                    f"{worst_cpu:.2f}× the peer's at worst over {len(ratios_cpu)} rounds"))
    if ratios_p50:
        worst = max(ratios_p50)
        targets.append((f"({k}) {what} on Redis adds no more p50 than the peer at the fixed rate", worst <= 1.0,
                        f"{worst:.2f}× the peer's at worst over {len(ratios_p50)} rounds"))
    for name, ok, detail in targets:
        add(f"- {'met' if ok else 'MISSED'}: {name}: {detail}.")
    add("")
    why = where_it_goes(cmp, by or {}) if k == "f" else ""
    if why:
        add(why)
        add("")
    return targets


def where_it_goes(cmp: PeerComparison, by: dict) -> str:
    """Cluster mode's added p50 and CPU, split into what the run's own setups put a number on:
    the filter's single-proxy work ((c) over (a)) and one stream round trip ((g) over (b))."""
    a, b, c, g = (by.get(k) for k in "abcg")
    if not (a and b and c and g and a.rate and b.rate and c.rate and g.rate and cmp.ours[0].rate):
        return ""
    f, bare, p = cmp.ours[-1], cmp.bare[-1], cmp.rounds[-1]
    single = c.rate.wrk.p50_ms - a.rate.wrk.p50_ms
    trip = g.rate.wrk.p50_ms - b.rate.wrk.p50_ms
    f_p50 = f.rate.wrk.p50_ms - bare.rate.wrk.p50_ms
    peer_p50 = p.rate.wrk.p50_ms - p.direct.wrk.p50_ms
    envoy = f.cpu_us_per_request - bare.cpu_us_per_request
    behind = f.coordination_cpu_us or 0.0
    return (f"Where the difference goes (last round, and the main setups of this run): of (f)'s "
            f"{f_p50:+.2f} ms of p50, the filter's single-proxy work alone adds {single:+.2f} ms "
            f"((c) over (a) at the same rate) and one stream message to an instant store "
            f"{trip:+.2f} ms ((g) over (b)): {single + trip:+.2f} ms before the store and Redis "
            f"do anything, against the peer's whole {peer_p50:+.2f} ms, which is one proxy hop and "
            f"Redis round trips. Of (f)'s {envoy + behind:+.0f} µs of CPU per write, Envoy spends "
            f"{envoy:+.0f} µs (the single-proxy filter, (c) over (a) saturated, {c.cpu_us_per_request - a.cpu_us_per_request:+.0f} µs, and "
            f"the stream), the store and Redis {behind:.0f} µs; the peer spends {p.cpu_us:.0f} µs "
            f"in all. Most of what (f) adds is the filter's work in Envoy and Envoy's stream to "
            f"the store: a second hop the peer, talking to Redis itself, does not make.")

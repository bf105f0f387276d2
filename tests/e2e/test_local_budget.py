"""The local table as a bounded cache, through real Envoy: a table far smaller than the
traffic keeps taking new keys (the oldest completed record gives up its slot), an in-flight
claim is never evicted, memory stays within ``local_table.max_bytes`` with hundreds of 1 MB
responses, one caller's flood cannot fail another caller's writes, and in cluster mode local
pressure falls back to the store instead of answering 503.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import harness
from harness import rss_kib
from cluster import cluster_plugin_config, post as cluster_post, start_cluster
from helpers import (
    is_replay,
    new_key,
    plugin_config,
    post,
    rule,
    rule_counters,
    start_envoy,
    unique_path,
)

GAUGE = "wasmcustom.idempotency.local_table.youngest_evicted_age_ms"
BODY_OMITTED = "idempotent-body-omitted"
MIB = 1 << 20


def write_then_settle(envoy: harness.Envoy, rule_name: str, outcome: str, expected: int) -> dict[str, int]:
    harness.wait_until(lambda: rule_counters(envoy, rule_name)[outcome] == expected, timeout=5,
                       what=f"{outcome} == {expected}")
    return rule_counters(envoy, rule_name)


def test_a_table_far_smaller_than_the_traffic_keeps_taking_new_keys(procs, upstream) -> None:
    """64 slots, 400 distinct writes: every one executes (201), the oldest records give up
    their slots (counted as evictions), the most recent keys still replay, and the gauge
    shows how young the youngest evicted record was."""
    slots = harness.table_geometry(64).capacity
    envoy = start_envoy(procs, upstream, plugin_config(rule("orders", prefixes=["/orders"]), capacity=slots),
                        name="envoy-small")
    started = time.monotonic()
    writes = [(unique_path("orders"), new_key()) for _ in range(400)]
    answers = [post(envoy, path, key=key) for path, key in writes]
    elapsed_ms = (time.monotonic() - started) * 1000
    assert [a.status_code for a in answers] == [201] * len(writes)
    assert not any(is_replay(a) for a in answers)

    # A key is evicted only by 8 newer keys in its own bucket: the last 8 are all still held.
    for (path, key), first in zip(writes[-8:], answers[-8:]):
        retry = post(envoy, path, key=key)
        assert is_replay(retry) and retry.content == first.content
        assert upstream.executions(path) == 1

    counters = write_then_settle(envoy, "orders", "replayed", 8)
    assert counters["executed"] == len(writes)
    assert counters["table_full"] == 0
    # Every bucket ends full (400 keys over 8 buckets): each key beyond the slots evicted one.
    assert counters["evicted"] == len(writes) - slots
    age = envoy.stats(filter=re.escape(GAUGE)).get(GAUGE)
    assert age is not None and 0 < age <= elapsed_ms, (age, elapsed_ms)


def test_an_in_flight_claim_is_never_evicted(procs, upstream) -> None:
    """One bucket of 8 slots: 4 slow writes hold their claims while 30 new keys churn through
    the other 4 slots. The slow keys still answer 409 (not a second execution), then replay."""
    slots = harness.table_geometry(1).capacity
    envoy = start_envoy(procs, upstream,
                        plugin_config(rule("orders", prefixes=["/orders"], lease_seconds=60), capacity=slots),
                        name="envoy-one-bucket")
    slow = [(unique_path("orders"), new_key()) for _ in range(slots // 2)]
    with ThreadPoolExecutor(max_workers=len(slow)) as pool:
        pending = [pool.submit(post, envoy, p, key=k, headers={"x-demo-delay-ms": "3000"}) for p, k in slow]
        harness.wait_until(lambda: upstream.total() == len(slow), timeout=10, what="slow claims in flight")
        churn = [post(envoy, unique_path("orders"), key=new_key()) for _ in range(30)]
        assert [c.status_code for c in churn] == [201] * 30
        for path, key in slow:
            assert post(envoy, path, key=key).status_code == 409
        originals = [f.result(timeout=20) for f in pending]
    assert [o.status_code for o in originals] == [201] * len(slow)
    for (path, key), original in zip(slow, originals):
        retry = post(envoy, path, key=key)
        assert is_replay(retry) and retry.content == original.content
        assert upstream.executions(path) == 1
    counters = rule_counters(envoy, "orders")
    assert counters["table_full"] == 0 and counters["evicted"] >= 30 - slots // 2


def test_hundreds_of_1mb_responses_keep_envoy_within_the_default_budget(procs, upstream) -> None:
    """With every setting at its default (64 MiB), 300 recorded 1 MB responses: Envoy's RSS
    grows by less than the budget plus the overhead docs/configuration.md
    "Sizing the local table" documents, the newest
    response replays whole, and the oldest replays its status with the body-omitted marker."""
    body_bytes = 1_000_000
    envoy = start_envoy(procs, upstream, plugin_config(rule("orders", prefixes=["/orders"])),
                        name="envoy-budget")
    big = {"x-demo-body-bytes": str(body_bytes)}
    # Warm-up on a path no rule covers: connections, buffers and allocator caches for 1 MB
    # answers are in the baseline, the table's growth is what is left.
    for _ in range(20):
        assert post(envoy, unique_path("unprotected"), key=new_key(), headers=big).status_code == 201
    time.sleep(0.5)
    baseline = rss_kib(envoy.process.pid)

    writes = [(unique_path("orders"), new_key()) for _ in range(300)]
    peak = baseline
    firsts = []
    for i, (path, key) in enumerate(writes):
        resp = post(envoy, path, key=key, headers=big)
        assert resp.status_code == 201 and len(resp.content) == body_bytes
        firsts.append(resp)
        if i % 10 == 0:
            peak = max(peak, rss_kib(envoy.process.pid))
    peak = max(peak, rss_kib(envoy.process.pid))

    newest_path, newest_key = writes[-1]
    replay = post(envoy, newest_path, key=newest_key)
    assert is_replay(replay) and replay.content == firsts[-1].content
    assert BODY_OMITTED not in replay.headers

    oldest_path, oldest_key = writes[0]
    replay = post(envoy, oldest_path, key=oldest_key)
    assert is_replay(replay) and replay.status_code == 201
    assert replay.headers.get(BODY_OMITTED) == "true" and replay.content == b""
    assert upstream.executions(oldest_path) == 1

    counters = rule_counters(envoy, "orders")
    assert counters["executed"] == len(writes) and counters["table_full"] == 0
    budget_kib = 64 * MIB // 1024
    # docs/configuration.md "Sizing the local table": 16 × the largest max_response_bytes per
    # worker.
    overhead_kib = envoy.concurrency * 16 * MIB // 1024
    grown = peak - baseline
    print(f"RSS baseline {baseline} KiB, peak {peak} KiB, grown {grown} KiB")
    assert grown <= budget_kib + overhead_kib, f"Envoy grew by {grown} KiB"


def test_a_flood_from_one_caller_cannot_fail_another_callers_writes(procs, upstream) -> None:
    """A 64-slot table; caller A sends 600 distinct keys from 8 threads while caller B
    writes 30 times, retrying each write at once: B's writes all execute once and replay."""
    slots = harness.table_geometry(64).capacity
    envoy = start_envoy(procs, upstream, plugin_config(rule("orders", prefixes=["/orders"]), capacity=slots),
                        name="envoy-flood")

    def flood(n: int) -> int:
        return post(envoy, unique_path("orders"), key=new_key(),
                    headers={"authorization": "Bearer caller-a"}).status_code

    b = {"authorization": "Bearer caller-b"}
    with ThreadPoolExecutor(max_workers=8) as pool:
        flooding = pool.map(flood, range(600))
        for _ in range(30):
            path, key = unique_path("orders"), new_key()
            first = post(envoy, path, key=key, headers=b)
            retry = post(envoy, path, key=key, headers=b)
            assert first.status_code == 201 and not is_replay(first)
            assert is_replay(retry) and retry.content == first.content
            assert upstream.executions(path) == 1
        assert set(flooding) == {201}
    counters = rule_counters(envoy, "orders")
    assert counters["table_full"] == 0 and counters["evicted"] > 0


def test_cluster_mode_local_pressure_falls_back_to_the_store(procs) -> None:
    """Cluster mode with one 8-slot bucket per Envoy: 12 concurrent slow writes (more than
    the table holds in flight) all execute once, none answers 503; then 40 more keys evict
    them locally, and every retry is still replayed, from the store."""
    plugin = cluster_plugin_config()
    plugin["local_table"] = {"capacity": harness.table_geometry(1).capacity}
    cluster = start_cluster(procs, plugin=plugin, envoys=1)
    envoy, upstream = cluster.a, cluster.upstream
    slow = [(unique_path("orders"), new_key()) for _ in range(12)]
    with ThreadPoolExecutor(max_workers=len(slow)) as pool:
        pending = [pool.submit(cluster_post, envoy, p, k, headers={"x-demo-delay-ms": "1500"}) for p, k in slow]
        firsts = [f.result(timeout=30) for f in pending]
    assert [f.status_code for f in firsts] == [201] * len(slow)
    for _ in range(40):
        assert cluster_post(envoy, unique_path("orders"), new_key()).status_code == 201

    def replayed_by_store() -> float:
        return cluster.store.metric("idempotency_store_operations_total", operation="claim",
                                    outcome="completed")

    before = replayed_by_store()
    for (path, key), first in zip(slow, firsts):
        retry = cluster_post(envoy, path, key)
        assert is_replay(retry) and retry.content == first.content
        assert upstream.executions(path) == 1
    # None of them was still local: each replay came from the store.
    assert replayed_by_store() - before == len(slow)
    counters = rule_counters(envoy, "orders")
    assert counters["table_full"] >= len(slow) - 8 and counters["evicted"] > 0

"""Wait mode (`on_in_flight: "wait"`) through real Envoy: duplicates of a write still running
are held and answered with its response instead of 409s, across every worker of the process
(single-proxy); 409 when `wait_ms` passes, a retry-able 503 when the first is released."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import harness
from cluster import cluster_plugin_config, post as cluster_post, start_cluster
from helpers import (
    crash_lines,
    is_replay,
    new_key,
    plugin_config,
    post,
    problem,
    rule,
    rule_counters,
    start_envoy,
    unique_path,
)

BODY = b'{"sku":"book","qty":1}'


def wait_rule(**fields) -> dict:
    return rule("orders", prefixes=["/orders"], on_in_flight="wait", **fields)


def duplicates(envoy: harness.Envoy, path: str, key: str, n: int, *, headers: dict) -> list:
    """``n`` identical requests at once, on connections of their own (so both workers get some)."""
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(post, envoy, path, key=key, body=BODY, headers=headers, timeout=30)
                   for _ in range(n)]
        return [f.result(timeout=60) for f in futures]


def test_concurrent_duplicates_across_workers_get_one_execution_and_identical_replays(procs) -> None:
    upstream = procs.upstream()
    envoy = start_envoy(procs, upstream, plugin_config(wait_rule(wait_ms=10_000)), concurrency=2)
    path, key = unique_path("orders"), new_key()
    answers = duplicates(envoy, path, key, 40, headers={"x-demo-delay-ms": "1500"})

    assert upstream.executions(path) == 1
    statuses = sorted({r.status_code for r in answers})
    assert statuses == [201], [r.status_code for r in answers]
    bodies = {r.content for r in answers}
    assert len(bodies) == 1, "every answer is the first request's response, byte for byte"
    replays = [r for r in answers if is_replay(r)]
    assert len(replays) == 39
    counts = rule_counters(envoy, "orders")
    assert counts["executed"] == 1 and counts["conflict"] == 0, counts
    assert counts["waited"] + counts["replayed"] == 39, counts
    assert counts["replayed_after_wait"] == counts["waited"], counts
    # Both workers held duplicates (connections spread over them): the cross-worker path ran.
    assert counts["waited"] >= 2, counts
    assert not crash_lines(envoy.log_text())


def test_a_held_duplicate_gets_409_after_wait_ms_and_503_when_the_first_fails(procs) -> None:
    upstream = procs.upstream()
    envoy = start_envoy(procs, upstream, plugin_config(wait_rule(wait_ms=500)), concurrency=2)

    path, key = unique_path("orders"), new_key()
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(post, envoy, path, key=key, body=BODY, headers={"x-demo-delay-ms": "2500"})
        harness.wait_until(lambda: upstream.executions(path) == 1, timeout=10, what="first upstream")
        late = post(envoy, path, key=key, body=BODY)
        assert first.result(timeout=20).status_code == 201
    doc = problem(late, 409, "request-in-flight", rule="orders")
    assert late.headers.get("retry-after") == "1", doc
    assert rule_counters(envoy, "orders")["wait_timed_out"] == 1

    path, key = unique_path("orders"), new_key()
    failing = {"x-demo-delay-ms": "300", "x-demo-status": "503"}
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(post, envoy, path, key=key, body=BODY, headers=failing)
        harness.wait_until(lambda: upstream.executions(path) == 1, timeout=10, what="first upstream")
        held = post(envoy, path, key=key, body=BODY)
        assert first.result(timeout=20).status_code == 503
    problem(held, 503, "first-attempt-released", rule="orders")
    assert held.headers.get("retry-after") == "1"
    assert upstream.executions(path) == 1, "the held duplicate did not run"
    retry = post(envoy, path, key=key, body=BODY)
    assert retry.status_code == 201 and upstream.executions(path) == 2
    assert rule_counters(envoy, "orders")["wait_released"] == 1


# --------------------------------------------------------------------------
# cluster mode: the first request runs on one replica, its duplicates on both
# --------------------------------------------------------------------------


def start_waiting_cluster(procs):
    plugin = cluster_plugin_config(timeout_ms=2000, on_in_flight="wait", wait_ms=15_000)
    return start_cluster(procs, plugin=plugin)


def test_a_hundred_duplicates_through_two_envoys_wait_and_get_the_first_response(procs) -> None:
    cluster = start_waiting_cluster(procs)
    path, key = unique_path("orders"), new_key()
    slow = {"x-demo-delay-ms": "2500"}
    with ThreadPoolExecutor(max_workers=101) as pool:
        first = pool.submit(cluster_post, cluster.a, path, key, headers=slow, timeout=30)
        harness.wait_until(lambda: cluster.upstream.executions(path) == 1, timeout=10, what="first upstream")
        envoys = [cluster.a, cluster.b]
        duplicates = [pool.submit(cluster_post, envoys[i % 2], path, key, headers=slow, timeout=30)
                      for i in range(100)]
        first = first.result(timeout=60)
        answers = [d.result(timeout=60) for d in duplicates]

    assert first.status_code == 201 and not is_replay(first)
    assert cluster.upstream.executions(path) == 1
    assert [r.status_code for r in answers] == [201] * 100, [r.content[:300] for r in answers if r.status_code != 201]
    assert all(is_replay(r) for r in answers)
    assert {r.content for r in answers} == {first.content}, "100 identical replays of the first"
    counts = [rule_counters(envoy, "orders") for envoy in envoys]
    assert sum(c["conflict"] for c in counts) == 0
    assert sum(c["replayed_after_wait"] for c in counts) == 100
    assert counts[1]["waited"] == 50, "B's duplicates waited on the store"
    assert cluster.store.metric("idempotency_store_operations_total",
                                operation="wait", outcome="completed") >= 50
    for envoy in envoys:
        assert not crash_lines(envoy.log_text())


def test_waiters_through_two_envoys_are_released_when_the_first_fails(procs) -> None:
    cluster = start_waiting_cluster(procs)
    path, key = unique_path("orders"), new_key()
    failing = {"x-demo-delay-ms": "1500", "x-demo-status": "503"}
    with ThreadPoolExecutor(max_workers=21) as pool:
        first = pool.submit(cluster_post, cluster.a, path, key, headers=failing, timeout=30)
        harness.wait_until(lambda: cluster.upstream.executions(path) == 1, timeout=10, what="first upstream")
        held = [pool.submit(cluster_post, (cluster.a, cluster.b)[i % 2], path, key, timeout=30)
                for i in range(20)]
        assert first.result(timeout=30).status_code == 503
        answers = [h.result(timeout=30) for h in held]
    for resp in answers:
        problem(resp, 503, "first-attempt-released", rule="orders")
        assert resp.headers.get("retry-after") == "1"
    assert cluster.upstream.executions(path) == 1, "no held duplicate ran"
    retry = cluster_post(cluster.b, path, key)
    assert retry.status_code == 201 and not is_replay(retry)
    assert cluster.upstream.executions(path) == 2


def test_a_duplicate_held_across_a_configuration_push_still_gets_the_response(procs, tmp_path) -> None:
    """Istio pushes configurations all the time: a duplicate held when one arrives is still
    answered by the configuration that holds it, with the first request's response."""
    from test_reconfigure import PushableEnvoy

    upstream = procs.upstream()
    pushed = PushableEnvoy(procs, tmp_path, upstream, plugin_config(wait_rule(wait_ms=10_000)))
    envoy = pushed.envoy
    path, key = unique_path("orders"), new_key()
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(post, envoy, path, key=key, body=BODY, headers={"x-demo-delay-ms": "3000"})
        harness.wait_until(lambda: upstream.executions(path) == 1, timeout=10, what="first upstream")
        held = pool.submit(post, envoy, path, key=key, body=BODY, timeout=30)
        harness.wait_until(lambda: rule_counters(envoy, "orders")["waited"] == 1, timeout=10,
                           what="the duplicate held")
        pushed.push(plugin_config(wait_rule(wait_ms=10_000, lease_seconds=120)))
        first, held = first.result(timeout=30), held.result(timeout=30)
    assert first.status_code == 201
    assert held.status_code == 201 and is_replay(held), held.content[:300]
    assert held.content == first.content
    assert upstream.executions(path) == 1
    assert not crash_lines(envoy.log_text())

"""End-to-end: unknown outcomes converge (docs/guarantees.md "Resolving an unknown outcome").

A write Envoy gave up on after it reached the demo upstream (a 1 s route timeout on a 2 s
payment) is an unknown outcome. With the rule's ``resolve``, once its settle time has passed
the Envoy that recorded it looks the payment up at the demo upstream's
``GET /payments/by-key/{key}``, as the caller (the demo upstream answers only the caller that
made the write, and only once the write has finished), and settles the key: the retry gets the
payment itself, or, if it never ran, runs it. Single-proxy mode, then two Envoys on one store,
then envoy/envoy.yaml's own payments sample as ``make run`` prints it.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest

import client
import harness
from cluster import post as cluster_post
from cluster import HOST, past_in_flight, start_cluster, wait_for_answer
from helpers import (
    needs_route_cluster,
    BODY_OMITTED,
    crash_lines,
    envoy_yaml_plugin_config,
    is_replay,
    new_key,
    prepend_routes,
    problem,
    rule,
    rule_counter,
    sample_single_proxy_config,
    start_envoy,
    unique_path,
    worker_connections,
)

# Every rule here takes its cluster from the route.
pytestmark = [needs_route_cluster]

SLOW = "/pay-slow"  # route timeout 1 s: Envoy gives up on a longer payment
RULE = "pay"
CALLER = {"authorization": "Bearer alice"}
SETTLE_SECONDS = 3
STATUS = "/pay-status"  # the rule's lookup route
# Logged by the proxy the store lets take a resolution on.
CLAIMED = "the store holds this proxy's claim on the unknown outcome's resolution"


def add_routes(config: dict) -> None:
    prepend_routes(config, [
        {"name": "pay-slow", "match": {"prefix": SLOW + "/"},
         "route": {"cluster": "demo_upstream", "timeout": "1s"}},
    ])


def pay_rule(**resolve: Any) -> dict:
    settings = {"path": "/payments/by-key/{key}", "settle_seconds": SETTLE_SECONDS,
                "backoff_seconds": 1, **resolve}
    return rule(RULE, prefixes=[SLOW], resolve=settings, lookup={"path": STATUS})


# The pay rule with tombstones, kept short: the service's answer whole for TTL_SECONDS after
# the resolution, then as its tombstone. A 1.5 s payment has finished by the settle time (1 s
# after the route's 1 s timeout), well before the unknown outcome's own TTL ends.
TTL_SECONDS = 3
SHORT_PAYMENT_MS = 1500


def pay_rule_keeping_tombstones() -> dict:
    return {**pay_rule(settle_seconds=1), "ttl_seconds": TTL_SECONDS,
            "lease_seconds": TTL_SECONDS, "tombstone_seconds": 300}


def assert_tombstone_of(resp: client.Response, resolved: client.Response) -> None:
    """``resp`` is the tombstone of ``resolved``: its status and marks, no body, a replay."""
    assert resp.status_code == resolved.status_code, (resp.status_code, resp.content[:300])
    assert is_replay(resp) and resp.headers.get(BODY_OMITTED) == "true", dict(resp.headers)
    assert resp.headers["idempotent-resolved"] == "true"
    assert resp.content == b""


def timed_out(envoy: harness.Envoy, path: str, key: str, delay_ms: int = 2000,
              **headers: str) -> float:
    """A payment the route gives up on after 1 s while the upstream goes on; returns when.
    Sent with the Host both replicas of a cluster test share (it is part of the scope)."""
    started = time.monotonic()
    first = cluster_post(envoy, path, key, headers={**CALLER, "x-demo-delay-ms": str(delay_ms), **headers})
    assert first.status_code == 504, first.content[:200]
    return started


def retry(envoy: harness.Envoy, path: str, key: str) -> client.Response:
    return cluster_post(envoy, path, key, headers=CALLER)


def assert_being_resolved(resp: client.Response) -> int:
    """409 outcome-unknown with a Retry-After (the key is being resolved); returns it."""
    problem(resp, 409, "outcome-unknown", rule=RULE)
    assert "retry-after" in resp.headers, dict(resp.headers)
    return int(resp.headers["retry-after"])


def resolved_answer(envoy: harness.Envoy, path: str, key: str, timeout: float = 15) -> client.Response:
    """Retries until the answer is not a 409 (bounded); every 409 meanwhile says when."""
    deadline = time.monotonic() + timeout
    while True:
        resp = retry(envoy, path, key)
        if resp.status_code != 409:
            return resp
        assert_being_resolved(resp)
        assert time.monotonic() < deadline, "still unknown"
        time.sleep(0.3)


@pytest.fixture
def edge(procs: harness.ProcessGroup) -> Iterator[tuple[harness.Envoy, harness.Upstream]]:
    upstream = procs.upstream()
    config = sample_single_proxy_config()
    config["rules"].append(pay_rule())
    envoy = start_envoy(procs, upstream, config, name="envoy-resolve", mutate=add_routes)
    yield envoy, upstream
    assert not crash_lines(envoy.log_text())


# --------------------------------------------------------------------------
# single-proxy mode
# --------------------------------------------------------------------------


def test_a_payment_that_went_through_is_replayed_once_the_service_says_so(edge) -> None:
    envoy, upstream = edge
    path, key = unique_path(SLOW), new_key()
    started = timed_out(envoy, path, key)
    # Before the settle time: told when to come back, never run, even once the payment
    # finished upstream (a lookup now would find it, but none is made before the settle time).
    first_wait = assert_being_resolved(retry(envoy, path, key))
    assert 1 <= first_wait <= SETTLE_SECONDS
    resolved = resolved_answer(envoy, path, key)
    assert time.monotonic() - started >= SETTLE_SECONDS
    assert resolved.status_code == 200, resolved.content[:300]
    assert resolved.headers["idempotent-resolved"] == "true"
    assert is_replay(resolved)
    assert resolved.json()["execution"] == 1 and resolved.json()["path"] == path
    assert "idempotency-key-expires" in resolved.headers
    again = retry(envoy, path, key)
    assert again.content == resolved.content and is_replay(again)
    assert upstream.executions(path) == 1
    assert rule_counter(envoy, RULE, "resolved_took_effect") == 1
    assert "unknown outcome resolved after 1 lookup(s) (the service answered 200)" in envoy.log_text()


def test_a_payment_resolved_as_taken_effect_keeps_its_tombstone_past_the_ttl(procs) -> None:
    """With ``tombstone_seconds``, the service's answer is kept as any completed response: a
    late redelivery after the TTL gets its status (the tombstone), and the charge is never
    made a second time."""
    upstream = procs.upstream()
    config = sample_single_proxy_config()
    config["rules"].append(pay_rule_keeping_tombstones())
    envoy = start_envoy(procs, upstream, config, name="envoy-tombstone", mutate=add_routes)
    path, key = unique_path(SLOW), new_key()
    timed_out(envoy, path, key, delay_ms=SHORT_PAYMENT_MS)
    resolved = resolved_answer(envoy, path, key)
    assert resolved.status_code == 200 and resolved.headers["idempotent-resolved"] == "true"
    time.sleep(TTL_SECONDS + 0.5)
    assert_tombstone_of(retry(envoy, path, key), resolved)
    assert upstream.executions(path) == 1
    assert rule_counter(envoy, RULE, "replayed_tombstone") == 1
    assert not crash_lines(envoy.log_text())


def test_a_payment_that_never_went_through_frees_its_key_and_the_retry_pays_once(edge) -> None:
    """The upstream failed the write after the route had given up (its 500 nobody saw): the
    lookup finds nothing, the key is freed, and the retry executes, once."""
    envoy, upstream = edge
    path, key = unique_path(SLOW), new_key()
    timed_out(envoy, path, key, **{"x-demo-status": "500"})
    again = resolved_answer(envoy, path, key)
    assert again.status_code == 201 and again.headers["x-execution"] == "2", again.content[:200]
    assert not is_replay(again)
    assert is_replay(retry(envoy, path, key))
    assert upstream.executions(path) == 2
    assert rule_counter(envoy, RULE, "resolved_never_ran") == 1


def test_a_payment_still_running_at_the_settle_time_is_not_freed_by_a_not_found(procs) -> None:
    """The payment takes 4.5 s; the service promises every write ends within 5 s (the settle
    time). A lookup 2.5 s in would say 404 and free a key whose payment is about to go through:
    the filter asks only after the settle time, so the retry gets the payment, never a second
    execution."""
    upstream = procs.upstream()
    config = sample_single_proxy_config()
    config["rules"].append(pay_rule(settle_seconds=5))
    envoy = start_envoy(procs, upstream, config, name="envoy-settle", mutate=add_routes)
    path, key = unique_path(SLOW), new_key()
    timed_out(envoy, path, key, delay_ms=4500)
    time.sleep(2.5)
    # The write is still running upstream (a lookup now would say 404): still unknown.
    assert upstream.executions(path) == 1
    assert_being_resolved(retry(envoy, path, key))
    resolved = resolved_answer(envoy, path, key)
    assert resolved.status_code == 200 and resolved.headers["idempotent-resolved"] == "true"
    assert upstream.executions(path) == 1
    assert rule_counter(envoy, RULE, "resolved_never_ran") == 0


def test_a_failing_lookup_is_asked_again_until_the_service_answers(edge) -> None:
    envoy, upstream = edge
    client.post(upstream.url("/__fail-lookups"), params={"n": 2}, timeout=5).raise_for_status()
    path, key = unique_path(SLOW), new_key()
    timed_out(envoy, path, key)
    resolved = resolved_answer(envoy, path, key, timeout=20)
    assert resolved.status_code == 200 and resolved.headers["idempotent-resolved"] == "true"
    assert upstream.executions(path) == 1
    assert rule_counter(envoy, RULE, "resolution_retried") == 2
    assert rule_counter(envoy, RULE, "resolved_took_effect") == 1


def test_a_lookup_answers_only_the_caller_who_made_the_write(procs) -> None:
    """The lookup carries the original caller's scope headers: the service finds the payment
    for alice. Another caller's retry of alice's key is another key altogether (the scope)."""
    upstream = procs.upstream()
    config = sample_single_proxy_config()
    config["rules"].append(pay_rule(max_attempts=1))
    envoy = start_envoy(procs, upstream, config, name="envoy-scope", mutate=add_routes)
    path, key = unique_path(SLOW), new_key()
    timed_out(envoy, path, key)
    bob = cluster_post(envoy, path, key, headers={"authorization": "Bearer bob"})
    assert bob.status_code == 201 and bob.headers["x-execution"] == "2", "bob's own key"
    resolved = resolved_answer(envoy, path, key)
    assert resolved.status_code == 200 and resolved.json()["execution"] == 1


def status_of(envoy: harness.Envoy, key: str, caller: str = "Bearer alice") -> client.Response:
    """The rule's lookup route: what the filter holds for ``key``, for ``caller``."""
    return client.request("GET", envoy.url(STATUS), body=None, timeout=5,
                          headers={"Host": HOST, "idempotency-key": key, "authorization": caller})


def test_a_caller_asks_what_became_of_its_key_and_only_its_own(edge) -> None:
    envoy, upstream = edge
    path, key = unique_path(SLOW), new_key()
    assert status_of(envoy, key).status_code == 404
    timed_out(envoy, path, key)
    asked = status_of(envoy, key)
    assert asked.status_code == 200 and asked.headers["content-type"] == "application/json"
    doc = asked.json()
    assert doc["state"] == "unknown" and doc["resolution"] == "pending", doc
    assert 1 <= doc["retry_after_seconds"] <= SETTLE_SECONDS
    # Another caller, same key: nothing to see (its scope is another record).
    assert status_of(envoy, key, "Bearer mallory").status_code == 404
    resolved_answer(envoy, path, key)
    done = status_of(envoy, key).json()
    assert done["state"] == "completed" and done["status"] == 200, done
    assert done["expires"].endswith("GMT")
    assert upstream.executions(path) == 1, "asking never executes"
    assert rule_counter(envoy, RULE, "looked_up") == 4


# --------------------------------------------------------------------------
# a key cannot steer the lookup
# --------------------------------------------------------------------------


def test_a_key_a_normaliser_would_rewrite_is_charged_at_most_once(procs) -> None:
    """The service routes its lookups on a normalised path, as nginx or a web framework does:
    ``/payments/by-key/..`` is ``/payments/``, and ``/payments/by-key/.`` is
    ``/payments/by-key/``, where nothing is found. A client pays under the key ``..`` (then
    ``.``), hangs up once the payment reached the service, waits the settle time and retries.
    Had the filter asked that lookup, its 404 would have freed the key and the retry paid a
    second time; it refuses such a key at the first request instead, before anything runs."""
    upstream = procs.upstream(extra_args=["--normalize-paths"])
    config = sample_single_proxy_config()
    config["rules"].append(pay_rule())
    envoy = start_envoy(procs, upstream, config, name="envoy-dot-keys", mutate=add_routes)
    firsts: dict[str, client.Response | None] = {}
    paths = {key: unique_path(SLOW) for key in ("..", ".")}
    for key, path in paths.items():
        try:
            firsts[key] = cluster_post(envoy, path, key, timeout=0.5,
                                       headers={**CALLER, "x-demo-delay-ms": "1500"})
        except client.HTTPError:
            firsts[key] = None  # hung up while the payment ran
    time.sleep(SETTLE_SECONDS + 1.5)
    for key, path in paths.items():
        again = resolved_answer(envoy, path, key)
        executions = upstream.executions(path)
        assert executions <= 1, f"key {key!r} was charged {executions} times"
        first = firsts[key]
        assert first is not None, f"key {key!r}: the first request ran"
        for answer in (first, again):
            doc = problem(answer, 400, "unfit-for-lookup", rule=RULE)
            assert f"would make '{key}' a segment of the lookup's path" in doc["detail"], doc
            assert "header 'idempotency-key'" in doc["detail"], doc
        assert executions == 0
    assert rule_counter(envoy, RULE, "invalid_key") == 4


# --------------------------------------------------------------------------
# cluster mode: two Envoys, one store
# --------------------------------------------------------------------------


@pytest.fixture
def replicas(procs: harness.ProcessGroup):
    config = envoy_yaml_plugin_config()
    config["rules"].append(pay_rule())
    cluster = start_cluster(procs, envoys=0)
    for name in ("envoy-a", "envoy-b"):
        cluster.add_envoy(name, config, mutate=add_routes)
    yield cluster
    for envoy in cluster.envoys:
        assert not crash_lines(envoy.log_text())


def test_cluster_the_replica_that_did_not_see_the_timeout_gets_the_payment(replicas) -> None:
    a, b = replicas.a, replicas.b
    path, key = unique_path(SLOW), new_key()
    timed_out(a, path, key)
    # The other replica learns from the store that the key is being resolved, and when (once
    # A's record of the timeout reached the store: in flight till then).
    assert_being_resolved(past_in_flight(lambda: cluster_post(b, path, key, headers=CALLER)))
    resolved = resolved_answer(b, path, key)
    assert resolved.status_code == 200 and resolved.headers["idempotent-resolved"] == "true"
    assert resolved.json()["execution"] == 1
    for envoy in (a, b):
        again = cluster_post(envoy, path, key, headers=CALLER)
        assert again.status_code == 200 and again.content == resolved.content
    assert replicas.upstream.executions(path) == 1
    # Either replica answers a caller's question from the store.
    for envoy in (a, b):
        doc = status_of(envoy, key).json()
        assert doc["state"] == "completed" and doc["status"] == 200, doc
    settled = replicas.store.metric("idempotency_store_operations_total", operation="settle",
                                    outcome="replaced")
    assert settled == 1
    assert "settled an unknown outcome" in replicas.store.log_text()


def test_cluster_a_payment_that_never_ran_is_freed_for_every_replica(replicas) -> None:
    a, b = replicas.a, replicas.b
    path, key = unique_path(SLOW), new_key()
    timed_out(b, path, key, **{"x-demo-status": "500"})
    again = resolved_answer(a, path, key)
    assert again.status_code == 201 and again.headers["x-execution"] == "2"
    # A's record of the retry reaches the store from its root a moment later: in flight till then.
    replay, _ = wait_for_answer(lambda: cluster_post(b, path, key, headers=CALLER), timeout=5)
    assert replay.status_code == 201 and replay.content == again.content
    assert replicas.upstream.executions(path) == 2


def test_cluster_a_payment_resolved_as_taken_effect_keeps_its_tombstone_past_the_ttl(procs) -> None:
    """Cluster mode: A resolves the payment. Past the TTL, a late redelivery through B (which
    never saw the key: it asks the store) and through A (its own copy) gets the tombstone; the
    charge is made once."""
    config = envoy_yaml_plugin_config()
    config["rules"].append(pay_rule_keeping_tombstones())
    cluster = start_cluster(procs, envoys=0)
    for name in ("envoy-a", "envoy-b"):
        cluster.add_envoy(name, config, mutate=add_routes)
    a, b = cluster.a, cluster.b
    path, key = unique_path(SLOW), new_key()
    timed_out(a, path, key, delay_ms=SHORT_PAYMENT_MS)
    resolved = resolved_answer(a, path, key)
    assert resolved.status_code == 200 and resolved.headers["idempotent-resolved"] == "true"
    time.sleep(TTL_SECONDS + 0.5)
    for envoy in (b, a):
        assert_tombstone_of(cluster_post(envoy, path, key, headers=CALLER), resolved)
    assert cluster.upstream.executions(path) == 1
    for envoy in cluster.envoys:
        assert not crash_lines(envoy.log_text())


def test_cluster_a_resolution_left_by_a_crashed_envoy_is_taken_on_by_the_other(procs) -> None:
    """Envoy A records the unknown outcome and dies (SIGKILL) before its lookup. Once the
    resolution is overdue in the store (its due time plus the lookup's timeout and 5 s), a
    retry through B takes it on with its own request's lookup: the payment replays, charged
    once."""
    config = envoy_yaml_plugin_config()
    config["rules"].append(pay_rule(settle_seconds=2, timeout_ms=1000))
    cluster = start_cluster(procs, envoys=0)
    for name in ("envoy-a", "envoy-b"):
        cluster.add_envoy(name, config, mutate=add_routes)
    a, b = cluster.a, cluster.b
    path, key = unique_path(SLOW), new_key()
    started = timed_out(a, path, key)
    # A's record of the unknown outcome reaches the store after its answer (on the native
    # build a hop later, through the main thread): only then does A die.
    assert_being_resolved(past_in_flight(lambda: retry(b, path, key)))
    a.process.kill()
    resolved = resolved_answer(b, path, key, timeout=25)
    assert resolved.status_code == 200 and resolved.headers["idempotent-resolved"] == "true"
    assert time.monotonic() - started >= 2 + 1 + 5
    assert resolved.json()["execution"] == 1
    assert cluster.upstream.executions(path) == 1
    assert CLAIMED in b.log_text()


def test_cluster_overdue_retries_on_every_worker_make_one_resolution_at_a_time(procs) -> None:
    """Envoy A records the unknown outcome and dies before its lookup. Once the resolution is
    overdue, bursts of retries reach both workers of B and of C at once while the service
    fails its first two lookups: one proxy takes the resolution on, and the service sees its
    three lookups and no other (one resolver at a time: each failed lookup moves the store's
    due time on, so nobody else takes it on meanwhile). Every retry meanwhile gets 409, then
    every replica replays the payment, charged once."""
    config = envoy_yaml_plugin_config()
    config["rules"].append(pay_rule(settle_seconds=2, timeout_ms=1000))
    cluster = start_cluster(procs, envoys=0)
    for name in ("envoy-a", "envoy-b", "envoy-c"):
        cluster.add_envoy(name, config, mutate=add_routes)
    a, others = cluster.a, cluster.envoys[1:]
    path, key = unique_path(SLOW), new_key()
    started = timed_out(a, path, key)
    # A's record of the unknown outcome reaches the store from its root after its answer (on
    # the native build a hop later, through the main thread): only then does A die.
    assert_being_resolved(past_in_flight(lambda: retry(others[0], path, key)))
    a.process.kill()
    client.post(cluster.upstream.url("/__fail-lookups"), params={"n": "2"},
                timeout=5).raise_for_status()
    # Overdue: A's 504 after 1 s, then the settle time, the lookup's timeout and 5 s.
    time.sleep(max(0.0, started + 1 + 2 + 1 + 5 + 0.5 - time.monotonic()))
    before = [worker_connections(envoy) for envoy in others]
    statuses: collections.Counter[int] = collections.Counter()
    resolved = None
    deadline = time.monotonic() + 20
    with ThreadPoolExecutor(max_workers=16) as pool:
        while resolved is None:
            assert time.monotonic() < deadline, f"still unknown: {statuses}"
            for resp in pool.map(lambda i: retry(others[i % 2], path, key), range(16)):
                statuses[resp.status_code] += 1
                if resp.status_code == 409:
                    # Or told that a concurrent retry on the same worker holds the key.
                    assert b"outcome-unknown" in resp.content or b"request-in-flight" in resp.content
                else:
                    assert resp.status_code == 200, resp.content[:200]
                    assert resp.headers["idempotent-resolved"] == "true"
                    resolved = resp
            time.sleep(0.25)
    for envoy, then in zip(others, before):
        spread = [now - was for now, was in zip(worker_connections(envoy), then)]
        assert len(spread) == 2 and min(spread) > 0, f"retries per worker: {spread}"
    assert cluster.upstream.lookups(f"/payments/by-key/{key}") == 3, statuses
    assert sum(CLAIMED in envoy.log_text() for envoy in others) == 1
    for envoy in others:
        again = retry(envoy, path, key)
        assert again.status_code == 200 and again.content == resolved.content
    assert resolved.json()["execution"] == 1
    assert cluster.upstream.executions(path) == 1
    for envoy in others:
        assert not crash_lines(envoy.log_text())


# --------------------------------------------------------------------------
# the make run sample
# --------------------------------------------------------------------------


def test_the_make_run_payment_sample_resolves(procs) -> None:
    """scripts/run-demo.sh's lines, against envoy/envoy.yaml as it is (cluster mode, the
    payments rule named by route metadata, settle time 5 s): a client that gives up after 1 s
    on a 3 s payment, then retries, gets 409 with Retry-After, then the payment."""
    cluster = start_cluster(procs, envoys=1)
    envoy = cluster.envoys[0]
    key = f"pay-{new_key()}"
    with pytest.raises(client.HTTPError):
        cluster_post(envoy, "/payments", key, headers={"x-demo-delay-ms": "3000"}, timeout=1)
    # Envoy learns of the hang-up a moment later: until then the first is still in flight.
    retry = cluster_post(envoy, "/payments", key)
    deadline = time.monotonic() + 3
    while "request-in-flight" in retry.text and time.monotonic() < deadline:
        time.sleep(0.1)
        retry = cluster_post(envoy, "/payments", key)
    assert_being_resolved_as(retry, "payments")
    pending = client.request("GET", envoy.url("/payments/idempotency-status"), body=None, timeout=5,
                             headers={"Host": HOST, "idempotency-key": key}).json()
    assert pending["state"] == "unknown" and "expires" not in pending, pending
    time.sleep(6)
    paid = cluster_post(envoy, "/payments", key)
    assert paid.status_code == 200, paid.content[:300]  # what the lookup answered
    assert paid.headers["idempotent-resolved"] == "true" and is_replay(paid)
    asked = client.request("GET", envoy.url("/payments/idempotency-status"), body=None, timeout=5,
                           headers={"Host": HOST, "idempotency-key": key})
    assert asked.status_code == 200 and asked.json()["state"] == "completed", asked.text
    # As docs/configuration.md shows for every completed record, from the store as locally.
    assert asked.json()["expires"] == paid.headers["idempotency-key-expires"], asked.text
    assert cluster.upstream.executions("/payments") == 1


def assert_being_resolved_as(resp: client.Response, rule_name: str) -> None:
    problem(resp, 409, "outcome-unknown", rule=rule_name)
    assert int(resp.headers["retry-after"]) >= 1, dict(resp.headers)

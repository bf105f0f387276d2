"""Cluster mode end to end: several Envoys built from envoy/envoy.yaml (only ports, the module
path and, where a test says so, the plugin configuration changed) share one idempotency store.

What a client sees is asserted through real processes: the demo upstream counts executions per
path, Envoy's admin stats give the filter's per-rule counters, the store's /metrics its side.
Every request carries the same Host (``api.test``) on every Envoy: ``:authority`` is part of
the default key scope, and behind a load balancer all replicas see the client's Host.

The store callout budget: envoy.yaml's ``timeout_ms: 250`` is a production latency budget. On
the shared 2-core machine these tests run on, claims were seen to exceed it now and then (Envoy
ends the callout with 504 and the filter, correctly, fails closed with 503), which is not what
these tests are about; so every test raises it to ``STORE_TIMEOUT_MS`` except the one that
tests the timeout itself. Everything else in the plugin configuration is envoy.yaml's.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import client
import harness
from cluster import (
    FakeStore,
    assert_unavailable,
    cluster_plugin_config as plugin_config,
    complete_while_store_down,
    completion_failure_logged,
    post,
    raw_post,
    start_cluster,
    store_over_http1,
    wait_for_answer,
    wasm_vm_failures,
)
from helpers import (
    PROBLEM_TYPE_BASE,
    crash_lines as crash_lines_of,
    is_replay,
    new_key,
    rule_counter,
    rule_counters,
    start_envoy,
    unique_path,
)

BACKENDS = ["embedded", "redis"]
STORE_TIMEOUT_MS = 2000


def config(**changes) -> dict:
    """envoy.yaml's plugin configuration with the test callout budget and ``changes``
    (see ``plugin_config``)."""
    changes.setdefault("timeout_ms", STORE_TIMEOUT_MS)
    return plugin_config(**changes)
COMPLETED = {"operation": "complete", "outcome": "completed"}
PROBLEM_IN_FLIGHT = PROBLEM_TYPE_BASE + "request-in-flight"


def crash_lines(text: str) -> list[str]:
    """A panic, a trap, or Envoy complaining about a failed VM."""
    return crash_lines_of(text, vm_failures=True)


@pytest.fixture(autouse=True)
def no_module_crash(procs):
    """After every test: no Envoy it started logged a panic, a trap or a failed VM."""
    yield
    for member in procs.members:
        if isinstance(member, harness.Envoy):
            lines = crash_lines(member.log_text())
            assert not lines, f"{member.name} logged a crash:\n" + "\n".join(lines[:20])


def wait_for_store_completions(cluster, count: int, timeout: float = 10.0) -> None:
    """The completion is sent from the root context after the response: wait until it landed."""
    harness.wait_until(lambda: cluster.store_completions() >= count, timeout=timeout,
                       what=f"{count} completion(s) at the store")


def assert_in_flight(resp: client.Response) -> None:
    assert resp.status_code == 409, (resp.status_code, resp.content[:200])
    assert resp.headers.get("content-type") == "application/problem+json"
    assert resp.json()["type"] == PROBLEM_IN_FLIGHT


# --------------------------------------------------------------------------
# 1. concurrency across replicas
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_duplicates_across_two_envoys_execute_once(procs, tmp_path, backend) -> None:
    """200 identical requests at once, alternating between two Envoys (2 workers each) that share
    the store: the upstream runs once, every other answer is a replay of that response or a 409,
    never a 5xx; afterwards both Envoys replay the same bytes."""
    cluster = start_cluster(procs, backend, plugin=config())
    path, key = unique_path(), new_key()
    n = 200
    barrier = threading.Barrier(n)

    def one(i: int) -> client.Response:
        envoy = cluster.envoys[i % 2]
        barrier.wait(timeout=60)
        return post(envoy, path, key, headers={"x-demo-delay-ms": "300"}, timeout=30)

    with ThreadPoolExecutor(max_workers=n) as pool:
        answers = list(pool.map(one, range(n)))

    statuses = collections.Counter((r.status_code, is_replay(r)) for r in answers)
    assert {s for s, _ in statuses} <= {201, 409}, statuses
    originals = [r for r in answers if r.status_code == 201 and not is_replay(r)]
    assert len(originals) == 1, statuses
    original = originals[0]
    assert original.headers["x-execution"] == "1"
    for r in answers:
        if r.status_code == 409:
            assert_in_flight(r)
        elif r is not original:
            assert is_replay(r) and r.content == original.content
    assert cluster.upstream.executions(path) == 1

    for envoy in cluster.envoys:
        replay, _ = wait_for_answer(lambda: post(envoy, path, key), timeout=10)
        assert (replay.status_code, is_replay(replay)) == (201, True)
        assert replay.content == original.content
    assert cluster.upstream.executions(path) == 1
    counters = [rule_counters(e, "orders") for e in cluster.envoys]
    assert sum(c["executed"] for c in counters) == 1, counters
    assert sum(c["store_error"] for c in counters) == 0, counters
    # One claim was granted cluster-wide; the other Envoy was turned away by the store.
    claims = {o: cluster.store.metric("idempotency_store_operations_total", operation="claim", outcome=o)
              for o in ("claimed", "in_flight", "completed")}
    assert claims["claimed"] == 1 and claims["in_flight"] + claims["completed"] >= 1, claims


# --------------------------------------------------------------------------
# 2-3. restarts
# --------------------------------------------------------------------------


NATIVE_HAS_NO_HTTP_TRANSPORT = pytest.mark.skipif(
    harness.FILTER_BUILD == "native",
    reason="the native build speaks to the store over its stream only (it refuses transport http)")


@pytest.mark.parametrize("transport", ["grpc", pytest.param("http", marks=NATIVE_HAS_NO_HTTP_TRANSPORT)])
def test_envoy_restart_replays_from_the_store(procs, tmp_path, transport) -> None:
    """A new Envoy process has empty shared data; the retry still replays, from the store.
    Both transports to the store: the stream (the default) and one callout per operation."""
    cluster = start_cluster(procs, plugin=config(transport=transport), envoys=1)
    path, key = unique_path(), new_key()
    first = post(cluster.a, path, key)
    assert first.status_code == 201 and not is_replay(first)
    wait_for_store_completions(cluster, 1)

    old_pid = cluster.a.process.pid
    cluster.a.restart()
    assert cluster.a.process.pid != old_pid

    retry = post(cluster.a, path, key)
    assert (retry.status_code, is_replay(retry)) == (201, True)
    assert retry.content == first.content
    assert cluster.upstream.executions(path) == 1
    counters = rule_counters(cluster.a, "orders")  # the new process's own counters
    assert (counters["executed"], counters["replayed"]) == (0, 1), counters
    assert cluster.store.metric("idempotency_store_operations_total",
                                operation="claim", outcome="completed") == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_completed_record_survives_store_restart(procs, tmp_path, backend) -> None:
    """embedded: same data dir; redis: AOF on, redis and the store both restarted. A fresh Envoy
    (no local copy) replays the record the restarted store still has."""
    cluster = start_cluster(procs, backend, plugin=config(), envoys=1)
    path, key = unique_path(), new_key()
    first = post(cluster.a, path, key)
    assert first.status_code == 201 and not is_replay(first)
    wait_for_store_completions(cluster, 1)

    cluster.store.stop()
    if backend == "redis":
        assert cluster.redis is not None
        cluster.redis.restart()
    cluster.store.start()
    fresh = cluster.add_envoy("envoy-fresh", config())

    retry = post(fresh, path, key)
    assert (retry.status_code, is_replay(retry)) == (201, True), retry.content[:200]
    assert retry.content == first.content
    assert cluster.upstream.executions(path) == 1
    assert rule_counters(fresh, "orders")["replayed"] == 1


def test_a_redis_restart_fails_no_protected_write(procs, tmp_path) -> None:
    """Redis restarts (AOF on) under a running store: the store's pooled connection to the
    old server is dead, yet the next protected writes execute (no 503), and the record made
    before the restart still replays."""
    cluster = start_cluster(procs, "redis", plugin=config(), envoys=1)
    path, key = unique_path(), new_key()
    first = post(cluster.a, path, key)
    assert first.status_code == 201 and not is_replay(first)
    wait_for_store_completions(cluster, 1)
    assert cluster.redis is not None
    for round in range(3):
        cluster.redis.restart()
        write_path = unique_path()
        answer = post(cluster.a, write_path, new_key())
        assert (answer.status_code, is_replay(answer)) == (201, False), (round, answer.content[:300])
        assert cluster.upstream.executions(write_path) == 1
    fresh = cluster.add_envoy("envoy-fresh", config())
    retry = post(fresh, path, key)
    assert (retry.status_code, is_replay(retry)) == (201, True), retry.content[:200]
    counters = rule_counters(cluster.a, "orders")
    assert counters["store_error"] == 0, counters


# --------------------------------------------------------------------------
# 4-7. store failures
# --------------------------------------------------------------------------

OPEN_RULE = {
    "name": "open",
    "match": {"path_prefixes": ["/open"]},
    "lease_seconds": 60,
    "on_store_error": "fail_open",
}


def test_store_down_fail_closed_and_fail_open_then_dedup_resumes(procs, tmp_path) -> None:
    """Store stopped: the fail_closed rule answers 503 without reaching the upstream; the
    fail_open rule executes on the local claim alone (so the other Envoy, which cannot see that
    claim, executes a retry again: the price of fail_open). Once the store is back on its port,
    a new key executes once and replays on the other Envoy."""
    cluster = start_cluster(procs, plugin=config(extra_rules=[OPEN_RULE]))
    a, b = cluster.a, cluster.b
    cluster.store.stop()

    closed_path, closed_key = unique_path(), new_key()
    assert_unavailable(post(a, closed_path, closed_key))
    assert cluster.upstream.executions(closed_path) == 0
    assert rule_counters(a, "orders")["store_error"] == 1

    open_path, open_key = unique_path("open"), new_key()
    passed = post(a, open_path, open_key)
    assert passed.status_code == 201 and not is_replay(passed)
    assert cluster.upstream.executions(open_path) == 1
    counters = rule_counters(a, "open")
    assert (counters["store_error"], counters["store_fail_open"], counters["executed"]) == (1, 1, 1)
    # The local claim still deduplicates this Envoy's own retries (no store needed for that).
    local = post(a, open_path, open_key)
    assert (local.status_code, is_replay(local), local.content) == (201, True, passed.content)
    # The other Envoy has neither the store nor the local record: it fails open and executes.
    other = post(b, open_path, open_key)
    assert other.status_code == 201 and not is_replay(other)
    assert cluster.upstream.executions(open_path) == 2
    assert "store unavailable for a claim" in a.log_text()

    cluster.store.start()  # same port, same data dir
    path, key = unique_path(), new_key()
    first = post(a, path, key)
    assert first.status_code == 201 and not is_replay(first)
    replay, _ = wait_for_answer(lambda: post(b, path, key), timeout=10)
    assert (replay.status_code, is_replay(replay), replay.content) == (201, True, first.content)
    assert cluster.upstream.executions(path) == 1
    # The request refused while the store was down can be retried now, and runs once.
    retried = post(b, closed_path, closed_key)
    assert retried.status_code == 201 and not is_replay(retried)
    assert cluster.upstream.executions(closed_path) == 1
    assert rule_counters(b, "orders")["store_error"] == 0


def test_a_record_on_its_way_to_the_store_answers_through_eviction_and_its_size(procs) -> None:
    """The soak's lost record: while the store is down a fail_open write runs on Envoy A's
    local claim alone, its response (600 kB) larger than A's small table keeps whole, and A's
    other writes press on the table. Until its completion reaches the store, A's local record
    is all that answers the key: a reuse with another payload gets 422 (before: it ran, and its
    record replaced the first one's in the store), a retry the status, never a second run.
    Once the store is back, the record lands and B replays it whole."""
    plugin = config(extra_rules=[OPEN_RULE])
    plugin["local_table"] = {"capacity": 8, "max_bytes": 1048576}
    cluster = start_cluster(procs, plugin=plugin)
    a, b = cluster.a, cluster.b
    for i in range(24):  # landed records, which eviction may take
        assert post(a, unique_path("open"), new_key()).status_code == 201
    cluster.store.stop()
    path, key = unique_path("open"), new_key()
    first = post(a, path, key, headers={"x-demo-body-bytes": "600000"})
    assert first.status_code == 201 and len(first.content) == 600000
    for i in range(24):  # pressure while the store is down: run, or refused for lack of room
        assert post(a, unique_path("open"), new_key()).status_code in (201, 503)
    assert rule_counters(a, "open")["evicted"] > 0

    reused = post(a, path, key, body=b'{"item":"car","qty":1}')
    assert reused.status_code == 422, (reused.status_code, reused.content[:200])
    retry = post(a, path, key)
    assert retry.status_code == 201 and is_replay(retry), (retry.status_code, retry.content[:200])
    assert cluster.upstream.executions(path) == 1

    cluster.store.start()  # same port, same data dir
    # A's waiting completions go on the first tick the store answers again (B, which never
    # saw the write, would run a retry before then: fail_open's price, not this test's).
    harness.wait_until(lambda: cluster.store.metric("idempotency_store_operations_total",
                                                    **COMPLETED) >= 1,
                       timeout=15, what="A's completions reaching the store")
    time.sleep(1.0)
    whole = post(b, path, key)
    assert whole.status_code == 201 and is_replay(whole) and whole.content == first.content
    assert cluster.upstream.executions(path) == 1


def test_store_slower_than_timeout_fails_closed_in_time(procs, tmp_path) -> None:
    """SIGSTOP on the store: connections are accepted by the kernel but nothing answers. With
    timeout_ms 200 (Envoy A) the client gets the fail_closed 503 after about 200 ms, and the
    upstream is not reached.

    After SIGCONT the store may still apply the claim Envoy gave up on (the request was already
    in its socket). The filter chose that claim's owner itself, so it releases it from the root
    context, retrying until the store answers: a retry soon executes, long before the 30 s
    lease would have freed the key, and never twice. The retries go through Envoy B, whose
    callout budget is the generous test one, so a busy machine cannot turn them into 503s.
    """
    lease = 30
    cluster = start_cluster(procs, plugin=plugin_config(timeout_ms=200, lease_seconds=lease),
                            envoys=1)
    b = cluster.add_envoy("envoy-b", config(lease_seconds=lease))
    path, key = unique_path(), new_key()
    cluster.store.pause()
    try:
        start = time.monotonic()
        resp = post(cluster.a, path, key)
        elapsed = time.monotonic() - start
    finally:
        cluster.store.resume()
    assert_unavailable(resp)
    assert 0.15 < elapsed < 0.2 + 1.0, elapsed
    assert cluster.upstream.executions(path) == 0
    assert rule_counters(cluster.a, "orders")["store_error"] == 1
    # The stream answered nothing in time: the filter's own deadline caught it.
    assert "answered nothing before the deadline" in cluster.a.log_text()

    answer, conflicts = wait_for_answer(lambda: post(b, path, key), timeout=10, interval=0.2)
    assert answer.status_code == 201 and not is_replay(answer), answer.content[:200]
    for c in conflicts:
        assert_in_flight(c)
    replay, _ = wait_for_answer(lambda: post(b, path, key), timeout=10)
    assert (replay.status_code, is_replay(replay), replay.content) == (201, True, answer.content)
    assert cluster.upstream.executions(path) == 1


GARBAGE_MODES = ["malformed_json", "status_500", "bad_base64", "not_a_record", "unknown_outcome", "close"]


@NATIVE_HAS_NO_HTTP_TRANSPORT
def test_store_answering_garbage_fails_by_policy_without_crashing(procs, tmp_path) -> None:
    """A fake store (Python, HTTP/1.1 only, so this Envoy talks HTTP/1.1 to the store cluster,
    over the HTTP transport) answers claims with malformed JSON, a 500, a record that is not
    base64, base64 that is not a record, an unknown outcome, or by closing the connection.
    Each gives the fail_closed 503 (fail_open: the request runs), is counted as store_error,
    and the module never traps. (Garbage on the stream is the codec's unit tests' part.) A
    completed record this proxy cannot read still says the key is taken: fail_open answers
    503 for it too, never running the write on it."""
    fake = FakeStore(procs, tmp_path)
    upstream = procs.upstream()
    plugin = config(extra_rules=[OPEN_RULE], transport="http")
    envoy = start_envoy(procs, upstream, plugin, store_port=fake.port,
                        name="envoy-garbage", mutate=store_over_http1)
    failed_open = 0
    for number, mode in enumerate(GARBAGE_MODES, start=1):
        fake.set_mode(mode)
        path = unique_path()
        assert_unavailable(post(envoy, path, new_key()))
        assert upstream.executions(path) == 0, mode
        open_path = unique_path("open")
        answered = post(envoy, open_path, new_key())
        if mode == "not_a_record":
            assert_unavailable(answered, rule="open")
            assert upstream.executions(open_path) == 0, mode
        else:
            failed_open += 1
            assert answered.status_code == 201 and not is_replay(answered), (mode, answered.content[:200])
            assert upstream.executions(open_path) == 1, mode
        assert fake.requests_in_mode(mode) >= 2, mode  # both claims really reached the fake
        assert rule_counter(envoy, "orders", "store_error") == number, mode
        assert rule_counters(envoy, "open")["store_fail_open"] == failed_open, mode

    assert envoy.alive()
    assert envoy.admin("/ready").status_code == 200
    log = envoy.log_text()
    assert "store unavailable for a claim" in log
    assert crash_lines(log) == []
    assert wasm_vm_failures(envoy) == {}
    if envoy.build == "wasm":  # the native build has no VM to reload
        assert envoy.stat("wasm.idempotency.vm_reload_failure", -1) == 0


def test_wrong_token_is_refused_and_fails_closed(procs, tmp_path) -> None:
    """Envoy sends a token the store does not accept: the store refuses the stream
    (UNAUTHENTICATED), the client gets the fail_closed 503, counted on both sides."""
    cluster = start_cluster(procs, plugin=config(token="not-the-store-token"),
                            envoys=1)
    rejected = cluster.store.metric("idempotency_store_rejected_requests_total", reason="unauthorized")
    path = unique_path()
    assert_unavailable(post(cluster.a, path, new_key()))
    assert cluster.upstream.executions(path) == 0
    assert rule_counters(cluster.a, "orders")["store_error"] == 1
    # Each worker's stream (and the main thread's) is refused, and reopened with backoff.
    assert cluster.store.metric("idempotency_store_rejected_requests_total",
                                reason="unauthorized") >= rejected + 1
    assert "UNAUTHENTICATED (16): the store does not accept this filter's store.token" \
        in cluster.a.log_text()


# --------------------------------------------------------------------------
# 8. client disconnects
# --------------------------------------------------------------------------


def test_client_gone_while_the_store_confirms_frees_the_key(procs, tmp_path) -> None:
    """The client hangs up while Envoy A waits for the store's answer to its claim (the store
    is paused, so the claim sits in its socket). Nothing went upstream, so A frees the key:
    its local claim at once, and the store claim (applied once the store resumes) through the
    root context's release. A retry through Envoy B then executes, long before the 30 s lease
    would have let it."""
    cluster = start_cluster(procs, plugin=config(lease_seconds=30))
    a, b = cluster.a, cluster.b
    path, key = unique_path(), new_key()
    cluster.store.pause()
    try:
        with raw_post(a, path, key) as raw:
            time.sleep(0.3)
            raw.abort()
        time.sleep(0.3)
    finally:
        cluster.store.resume()
    answer, conflicts = wait_for_answer(lambda: post(b, path, key), timeout=10, interval=0.2)
    assert answer.status_code == 201 and not is_replay(answer), answer.content[:200]
    for c in conflicts:
        assert_in_flight(c)
    assert cluster.upstream.executions(path) == 1
    replay, _ = wait_for_answer(lambda: post(a, path, key), timeout=10)
    assert (replay.status_code, is_replay(replay), replay.content) == (201, True, answer.content)


def test_completion_survives_client_hangup_and_store_outage(procs, tmp_path) -> None:
    """The guarantee of the root-context write queue, made deterministic: the store goes down
    while the upstream works, the client reads the whole response and hangs up (RST), and only
    then the store comes back (embedded, same data dir, so the claim is still there). The
    request's context is gone, yet the completion is retried by the root context until it
    lands: a retry through the OTHER Envoy (no local copy there) replays it.

    (A plain hang-up right after the response is not deterministic: the completion has almost
    always reached a live store before the client's RST arrives.)
    """
    cluster = start_cluster(procs, plugin=config())
    a, b = cluster.a, cluster.b
    path, key = unique_path(), new_key()
    body = complete_while_store_down(a, cluster, path, key, delay_ms=2000)
    assert completion_failure_logged(a)

    cluster.store.start()
    replay, _ = wait_for_answer(lambda: post(b, path, key), timeout=15, interval=0.2)
    assert (replay.status_code, is_replay(replay)) == (201, True), replay.content[:200]
    assert replay.content == body
    assert cluster.upstream.executions(path) == 1
    assert cluster.store_completions() == 1


def test_a_completion_landed_for_an_idle_worker_and_sent_again_by_it_changes_nothing(procs, tmp_path) -> None:
    """The store stops while a write runs; the client reads its 201 and leaves, and no request
    reaches that worker afterwards. On the native build the main thread lands the completion
    once the store is back (the write handoff); when requests then reach that Envoy again, its
    worker's root sends its own copy too (same bytes): the store answers "completed" and
    changes nothing. Every request through the Envoy's workers after that is harmless, the
    retry through the other Envoy replays, the upstream ran once, nothing counted lost."""
    cluster = start_cluster(procs, plugin=config(lease_seconds=5))
    a, b = cluster.a, cluster.b
    path, key = unique_path(), new_key()
    body = complete_while_store_down(a, cluster, path, key)
    cluster.store.start()
    wait_for_store_completions(cluster, 1, timeout=10)
    # Wake every worker of Envoy A (its roots drain what waited), with writes of their own.
    for _ in range(8):
        other = post(a, unique_path(), new_key())
        assert other.status_code == 201 and not is_replay(other)
    time.sleep(3)  # the woken roots' own retries of the completion (backoff capped at 2 s)
    replay = post(b, path, key)
    assert (replay.status_code, is_replay(replay), replay.content) == (201, True, body)
    assert cluster.upstream.executions(path) == 1
    for counter in ("not_recorded", "store_write_dropped"):
        assert rule_counter(a, "orders", counter) == 0, counter


def test_client_gone_in_the_middle_of_a_large_body_is_recorded_without_it(procs, tmp_path) -> None:
    """The client reads the 201 headers of a 16 MiB response and hangs up: Envoy resets the
    stream before the upstream body has passed the filter. The upstream executed and the
    client saw 201, so the filter records what it saw, status and headers without the body,
    when the stream ends: a retry through the other Envoy gets that answer with the
    omitted-body marker instead of a second execution.
    """
    cluster = start_cluster(procs, plugin=config(lease_seconds=30))
    a, b = cluster.a, cluster.b
    path, key = unique_path(), new_key()
    with raw_post(a, path, key, headers={"x-demo-body-bytes": str(16 * 1024 * 1024)}, recv_buffer=4096) as raw:
        assert raw.read_head(timeout=15).status == 201
        raw.abort()
    assert cluster.upstream.executions(path) == 1
    replay, conflicts = wait_for_answer(lambda: post(b, path, key), timeout=10, interval=0.2)
    for c in conflicts:
        assert_in_flight(c)
    assert (replay.status_code, is_replay(replay), replay.content) == (201, True, b"")
    assert replay.headers.get("idempotent-body-omitted") == "true"
    assert replay.headers.get("content-type") == "text/plain"
    assert cluster.upstream.executions(path) == 1

    # Contrast: a body Envoy holds whole is recorded although the client left after the head.
    path2, key2 = unique_path(), new_key()
    with raw_post(a, path2, key2, headers={"x-demo-body-bytes": str(256 * 1024)}, recv_buffer=4096) as raw:
        assert raw.read_head(timeout=15).status == 201
        raw.abort()
    replay, _ = wait_for_answer(lambda: post(b, path2, key2), timeout=10)
    assert (replay.status_code, is_replay(replay), len(replay.content)) == (201, True, 256 * 1024)
    assert cluster.upstream.executions(path2) == 1


# --------------------------------------------------------------------------
# 9-10. local copies and releases
# --------------------------------------------------------------------------


def test_store_answer_is_cached_locally(procs, tmp_path) -> None:
    """Once Envoy B replayed a record from the store it keeps a local copy: with the store down,
    B still replays that key, while a new key on B gets the fail_closed 503."""
    cluster = start_cluster(procs, plugin=config())
    a, b = cluster.a, cluster.b
    path, key = unique_path(), new_key()
    first = post(a, path, key)
    assert first.status_code == 201
    wait_for_store_completions(cluster, 1)
    from_store = post(b, path, key)
    assert (from_store.status_code, is_replay(from_store), from_store.content) == (201, True, first.content)

    cluster.store.stop()
    local = post(b, path, key)
    assert (local.status_code, is_replay(local), local.content) == (201, True, first.content)
    assert rule_counters(b, "orders")["store_error"] == 0  # no callout was needed

    new_path = unique_path()
    assert_unavailable(post(b, new_path, new_key()))
    assert rule_counters(b, "orders")["store_error"] == 1
    assert cluster.upstream.executions(path) == 1
    assert cluster.upstream.executions(new_path) == 0


def test_upstream_error_releases_the_store_claim(procs, tmp_path) -> None:
    """An upstream 503 releases the claim cluster-wide (the release goes to the store from A's
    root context): a retry through the other Envoy executes again."""
    cluster = start_cluster(procs, plugin=config())
    a, b = cluster.a, cluster.b
    path, key = unique_path(), new_key()
    failed = post(a, path, key, headers={"x-demo-status": "503"})
    assert failed.status_code == 503 and not is_replay(failed)
    assert failed.headers.get("content-type") == "application/json"  # the upstream's own 503
    assert rule_counters(a, "orders")["released"] == 1

    # The fingerprint covers method, path and body, not the x-demo-* headers.
    retried, _ = wait_for_answer(lambda: post(b, path, key), timeout=10)
    assert retried.status_code == 201 and not is_replay(retried), retried.content[:200]
    assert retried.headers["x-execution"] == "2"
    assert cluster.upstream.executions(path) == 2
    assert cluster.store.metric("idempotency_store_operations_total",
                                operation="release", outcome="released") == 1
    replay, _ = wait_for_answer(lambda: post(a, path, key), timeout=10)
    assert (replay.status_code, is_replay(replay), replay.content) == (201, True, retried.content)


# --------------------------------------------------------------------------
# 11. rules that never read the body
# --------------------------------------------------------------------------


def test_body_waits_for_the_store_when_the_rule_never_reads_it(procs, tmp_path) -> None:
    """A rule with a header key and ``"fingerprint": "none"`` claims at request headers and
    never buffers the body for itself. Its body must still wait while the store confirms the
    claim: a body passed on before the store answered would run the request upstream first.
    The same key with the same body through the other Envoy (no local record there) gets the
    replay, and the upstream ran once. (Regression: Envoy B used to execute it again.)"""
    cluster = start_cluster(procs, plugin=config(fingerprint="none"))
    a, b = cluster.a, cluster.b
    path, key = unique_path(), new_key()
    body = b'{"sku":"book","qty":1,"note":"' + b"x" * 4096 + b'"}'
    first = post(a, path, key, body=body)
    assert first.status_code == 201 and not is_replay(first)
    wait_for_store_completions(cluster, 1)

    retry = post(b, path, key, body=body)
    assert (retry.status_code, is_replay(retry)) == (201, True), retry.content[:200]
    assert retry.content == first.content
    assert cluster.upstream.executions(path) == 1
    counters = rule_counters(b, "orders")
    assert (counters["executed"], counters["replayed"]) == (0, 1), counters


# --------------------------------------------------------------------------
# 12. store outages longer than a few seconds
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_completion_survives_a_store_outage_of_many_seconds(procs, tmp_path, backend) -> None:
    """The store is down for 12 s (the filter once gave completions up after about 6 s of
    retries), longer than the claim's 5 s lease, while a request completes and its client
    hangs up. The completion waits in the root context's retry buffer and lands once the
    store is back, quickly (the backoff is capped, and the first store answer flushes the
    buffer), although the claim it completes has lapsed (Redis has even deleted it): it
    carries the claim's fingerprint, so the store records it. A retry through the OTHER Envoy
    then replays instead of executing again. Nothing was dropped."""
    cluster = start_cluster(procs, backend, plugin=config(lease_seconds=5))
    a, b = cluster.a, cluster.b
    path, key = unique_path(), new_key()
    down_since = time.monotonic()
    complete_while_store_down(a, cluster, path, key)
    # Longer than the old retry window and than the claim's lease.
    time.sleep(max(0.0, 12 - (time.monotonic() - down_since)))
    assert rule_counter(a, "orders", "store_write_dropped") == 0

    cluster.store.start()  # same port and data dir (or the same Redis)
    back = time.monotonic()
    wait_for_store_completions(cluster, 1, timeout=10)
    assert time.monotonic() - back < 2 + 1.5, "the queued completion should land within the capped backoff"
    replay = post(b, path, key)
    assert (replay.status_code, is_replay(replay)) == (201, True), replay.content[:200]
    assert cluster.upstream.executions(path) == 1
    assert rule_counter(a, "orders", "store_write_dropped") == 0


def without_headers_stop_iteration(envoy_config: dict) -> None:
    """``mutate`` for Envoy: the Wasm filter without ``allow_on_headers_stop_iteration``."""
    for node in harness._walk_dicts(envoy_config):
        if "allow_on_headers_stop_iteration" in node:
            node["allow_on_headers_stop_iteration"] = False


def test_large_bodies_of_a_rule_that_never_reads_them(procs, tmp_path) -> None:
    """While the store confirms a claim, the body waits in Envoy. With
    ``allow_on_headers_stop_iteration: true`` (needed by any rule that reads the body) the SDK
    can only ask Envoy to buffer it, so a body larger than the listener's buffer limit (1 MiB
    in envoy.yaml) gets Envoy's own 413 and nothing runs: pinned here, as
    docs/configuration.md "Failure policy of the Wasm VM" states.
    Without the flag (possible when no rule reads the body) Envoy holds the body with flow
    control instead: the 4 MiB upload executes once and its retry through the other Envoy
    replays."""
    body = b"x" * (4 * 1024 * 1024)
    buffered = start_cluster(procs, plugin=config(fingerprint="none"), envoys=1)
    if harness.FILTER_BUILD == "wasm":
        # The native build has no such flag: a request held at its headers for the store
        # always keeps its body with flow control (crates/native-filter/src/filter.rs).
        path, key = unique_path(), new_key()
        # The store sits on the claim while the body arrives: a store quicker than the upload
        # would confirm it before the buffer filled, and the body would stream on.
        buffered.store.pause()
        try:
            refused = post(buffered.a, path, key, body=body)
        finally:
            buffered.store.resume()
        assert refused.status_code == 413, refused.content[:200]
        assert buffered.upstream.executions(path) == 0

    a = buffered.add_envoy("envoy-flow-a", config(fingerprint="none"),
                           mutate=without_headers_stop_iteration)
    b = buffered.add_envoy("envoy-flow-b", config(fingerprint="none"),
                           mutate=without_headers_stop_iteration)
    path, key = unique_path(), new_key()
    first = post(a, path, key, body=body)
    assert first.status_code == 201 and not is_replay(first), first.content[:200]
    wait_for_store_completions(buffered, 1)
    retry = post(b, path, key, body=body)
    assert (retry.status_code, is_replay(retry), retry.content) == (201, True, first.content)
    assert buffered.upstream.executions(path) == 1


# --------------------------------------------------------------------------
# 12. a store whose message limit is below a rule's responses
# --------------------------------------------------------------------------


def test_a_completion_over_the_stores_limit_lands_without_its_body_and_keeps_the_stream(procs, tmp_path) -> None:
    """A store started with --max-body-bytes 1 MiB under a rule that records 3 MiB: a 2 MB
    response used to end the worker's stream (OUT_OF_RANGE), never landed, and once the lease
    passed the write ran again through the other Envoy. The store announces its limit when the
    stream opens; the completion goes without its body, and the stream carries on."""
    from cluster import Cluster, start_backend

    store = start_backend(procs, "embedded", extra_args=["--max-body-bytes", "1048576"])
    cluster = Cluster(procs=procs, upstream=procs.upstream(), store=store, envoys=[])
    rule_changes = {"max_response_bytes": 3 << 20, "lease_seconds": 1}
    a = cluster.add_envoy("envoy-a", config(**rule_changes))
    b = cluster.add_envoy("envoy-b", config(**rule_changes))
    path, key = unique_path(), new_key()
    first = post(a, path, key, headers={"x-demo-body-bytes": str(2_000_000)})
    assert first.status_code == 201 and len(first.content) == 2_000_000
    replay, _ = wait_for_answer(lambda: post(b, path, key), timeout=15)
    assert is_replay(replay), replay.content[:200]
    assert replay.status_code == 201 and replay.content == b""
    assert replay.headers.get("idempotent-body-omitted") == "true"
    assert cluster.upstream.executions(path) == 1
    # The stream that carried it still answers: the next write through A is recorded as usual.
    other, other_key = unique_path(), new_key()
    assert post(a, other, other_key).status_code == 201
    again, _ = wait_for_answer(lambda: post(b, other, other_key), timeout=10)
    assert is_replay(again)
    assert rule_counter(a, "orders", "store_write_dropped") == 0

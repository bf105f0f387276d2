"""End-to-end: a write Envoy, its router or the client gave up on after it may have reached
the upstream never runs twice (docs/guarantees.md "Unknown outcomes").

Envoy from envoy/envoy.yaml, with routes added for each way Envoy gives up: a route timeout
shorter than the write, a retry policy with a per-try timeout, a cluster nobody listens on,
an HTTP/2 upstream that refuses streams.
Each test counts the demo upstream's executions of its own path. Single-proxy mode (the
sample's plugin configuration without its store), then cluster mode (two Envoys sharing one
store), since a retry of an unknown outcome may land on any replica.
"""

from __future__ import annotations

import collections
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest

import client
import harness
from cluster import raw_post, start_cluster, wait_for_answer
from cluster import post as cluster_post
from helpers import (
    crash_lines,
    envoy_yaml_plugin_config,
    is_replay,
    line_for,
    new_key,
    post,
    add_h2_cluster,
    add_refused_cluster,
    prepend_routes,
    problem,
    rule,
    rule_counter,
    sample_single_proxy_config,
    start_envoy,
    start_refusing_h2_server,
    unique_path,
    worker_connections,
)

# The routes each test sends to: their timeouts and policies are what Envoy gives up by.
SLOW_ROUTE = "/edge-slow"  # route timeout 1 s
RETRIED = "/edge-retried"  # retry_policy 5xx,reset x2, per-try timeout 1 s (Istio's shape)
REFUSED = "/edge-refused"  # a cluster whose port nobody listens on
PLAIN = "/edge"  # the sample's 15 s route
H2_REFUSING = "/edge-h2"  # an HTTP/2 upstream that refuses each key's first stream
H2_REFUSING_RETRIED = "/edge-h2-retried"  # the same, under Istio's retry on refused streams
EDGE_RULE = "edge"


def add_routes(config: dict) -> None:
    """``mutate`` for envoy/envoy.yaml: the routes above, ahead of the catch-all."""
    prepend_routes(config, [
        {"name": "edge-slow", "match": {"prefix": SLOW_ROUTE + "/"},
         "route": {"cluster": "demo_upstream", "timeout": "1s"}},
        {"name": "edge-retried", "match": {"prefix": RETRIED + "/"},
         "route": {"cluster": "demo_upstream", "timeout": "10s",
                   "retry_policy": {"retry_on": "5xx,reset", "num_retries": 2,
                                    "per_try_timeout": "1s"}}},
        {"name": "edge-refused", "match": {"prefix": REFUSED + "/"},
         "route": {"cluster": "refused", "timeout": "5s"}},
    ])
    add_refused_cluster(config)


def edge_rule(**fields: Any) -> dict:
    return rule(EDGE_RULE, prefixes=[PLAIN], **fields)


def single_proxy_config(**fields: Any) -> dict:
    config = sample_single_proxy_config()
    config["rules"].append(edge_rule(**fields))
    return config


def assert_outcome_unknown(resp: client.Response) -> dict:
    """The answer to a retry of a write whose outcome is unknown: 409, no Retry-After."""
    doc = problem(resp, 409, "outcome-unknown", rule=EDGE_RULE)
    assert "retry-after" not in resp.headers, dict(resp.headers)
    assert not is_replay(resp)
    return doc


def wait_done(upstream: harness.Upstream, path: str, executions: int = 1) -> None:
    """Waits for the upstream to have started the write (it counts before any delay)."""
    harness.wait_until(lambda: upstream.executions(path) >= executions, timeout=10,
                       what=f"{executions} execution(s) of {path}")


@pytest.fixture
def edge(procs: harness.ProcessGroup) -> Iterator[tuple[harness.Envoy, harness.Upstream]]:
    upstream = procs.upstream()
    envoy = start_envoy(procs, upstream, single_proxy_config(), name="envoy-edge",
                        mutate=add_routes)
    yield envoy, upstream
    assert not crash_lines(envoy.log_text())


# --------------------------------------------------------------------------
# single-proxy mode
# --------------------------------------------------------------------------


def test_a_route_timeout_while_the_upstream_still_works_is_never_run_again(edge) -> None:
    """The incident the product exists for: Envoy's route timeout answers 504 while the
    payment goes through; the retry must not charge again."""
    envoy, upstream = edge
    path, key = unique_path(SLOW_ROUTE), new_key()
    first = post(envoy, path, key=key, headers={"x-demo-delay-ms": "2000"})
    assert first.status_code == 504, first.content[:200]
    time.sleep(1.3)  # the upstream finished the write meanwhile
    assert upstream.executions(path) == 1
    for _ in range(3):
        assert_outcome_unknown(post(envoy, path, key=key))
    assert upstream.executions(path) == 1
    assert rule_counter(envoy, EDGE_RULE, "outcome_unknown") == 1
    assert rule_counter(envoy, EDGE_RULE, "outcome_unknown_answered") == 3
    assert rule_counter(envoy, EDGE_RULE, "released") == 0


def test_a_per_try_timeout_retry_policy_sends_the_write_once(edge) -> None:
    """A route retrying 5xx and resets with a 1 s per-try timeout sent one POST to the
    upstream three times; the filter caps the router at no retry, and the attempt's timeout
    is an unknown outcome."""
    envoy, upstream = edge
    path, key = unique_path(RETRIED), new_key()
    first = post(envoy, path, key=key, headers={"x-demo-delay-ms": "1500"})
    assert first.status_code == 504, first.content[:200]
    time.sleep(1.0)
    assert upstream.executions(path) == 1, "the router did not resend it"
    assert_outcome_unknown(post(envoy, path, key=key))
    assert upstream.executions(path) == 1
    assert rule_counter(envoy, EDGE_RULE, "resent") == 0


def test_an_upstream_that_resets_after_reading_the_request_is_not_run_again(edge) -> None:
    envoy, upstream = edge
    path, key = unique_path(PLAIN), new_key()
    first = post(envoy, path, key=key, headers={"x-demo-reset": "1"})
    assert first.status_code == 503, first.content[:200]
    assert upstream.executions(path) == 1
    assert_outcome_unknown(post(envoy, path, key=key))
    assert upstream.executions(path) == 1


def test_a_client_that_hangs_up_leaves_an_unknown_outcome_not_a_lease(edge) -> None:
    """Before: retries got 409 until the lease passed, then one executed again."""
    envoy, upstream = edge
    path, key = unique_path(PLAIN), new_key()
    with raw_post(envoy, path, key, headers={"x-demo-delay-ms": "1500"}) as raw:
        wait_done(upstream, path)
        raw.abort()
    harness.wait_until(lambda: rule_counter(envoy, EDGE_RULE, "outcome_unknown") == 1,
                       timeout=10, what="the hang-up recorded as an unknown outcome")
    time.sleep(1.7)  # the write completed upstream, unseen
    for _ in range(2):
        assert_outcome_unknown(cluster_post(envoy, path, key))
    assert upstream.executions(path) == 1


def test_a_write_that_outlives_its_lease_is_renewed_not_taken_over(edge, procs) -> None:
    envoy, upstream = edge
    short = start_envoy(procs, upstream, single_proxy_config(lease_seconds=1),
                        name="envoy-short-lease", mutate=add_routes)
    path, key = unique_path(PLAIN), new_key()
    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(post, short, path, key=key, headers={"x-demo-delay-ms": "3000"})
        wait_done(upstream, path)
        time.sleep(1.8)  # past the 1 s lease: before renewals, a retry took it over
        retry = post(short, path, key=key)
        problem(retry, 409, "request-in-flight", rule=EDGE_RULE)
        done = first.result(timeout=20)
    assert done.status_code == 201 and done.headers["x-execution"] == "1"
    replay = post(short, path, key=key)
    assert is_replay(replay) and replay.content == done.content
    assert upstream.executions(path) == 1
    assert rule_counter(short, EDGE_RULE, "taken_over") == 0


def test_a_connection_refusal_stays_retryable(edge, procs) -> None:
    """Nothing reached an upstream: the key is freed, so a retry is Envoy's to answer again
    (and executes once the upstream is back), never the filter's 409."""
    envoy, _ = edge
    key = new_key()
    path = unique_path(REFUSED)
    for attempt in (1, 2):
        resp = post(envoy, path, key=key)
        assert resp.status_code == 503 and "problem+json" not in resp.headers.get("content-type", ""), \
            resp.content[:200]
        assert rule_counter(envoy, EDGE_RULE, "released") == attempt
    assert rule_counter(envoy, EDGE_RULE, "outcome_unknown") == 0
    # The upstream comes back on the port that refused: the retry runs, once.
    refused = next(c for c in envoy.config["static_resources"]["clusters"] if c["name"] == "refused")
    port = refused["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"]["port_value"]
    back = procs.upstream(port=port, name="refused-upstream")
    done = post(envoy, path, key=key)
    assert done.status_code == 201 and not is_replay(done), done.content[:200]
    assert is_replay(post(envoy, path, key=key))
    assert back.executions(path) == 1


def test_the_upstreams_own_500_follows_release_on_status(edge) -> None:
    envoy, upstream = edge
    path, key = unique_path(PLAIN), new_key()
    failed = post(envoy, path, key=key, headers={"x-demo-status": "500"})
    assert failed.status_code == 500
    again = post(envoy, path, key=key)
    assert again.status_code == 201 and again.headers["x-execution"] == "2"
    assert is_replay(post(envoy, path, key=key))
    assert upstream.executions(path) == 2
    assert rule_counter(envoy, EDGE_RULE, "outcome_unknown") == 0


def test_on_unknown_outcome_release_frees_the_key_as_before(procs) -> None:
    upstream = procs.upstream()
    envoy = start_envoy(procs, upstream, single_proxy_config(on_unknown_outcome="release"),
                        name="envoy-release", mutate=add_routes)
    path, key = unique_path(SLOW_ROUTE), new_key()
    assert post(envoy, path, key=key, headers={"x-demo-delay-ms": "1500"}).status_code == 504
    again = post(envoy, path, key=key)
    assert again.status_code == 201 and again.headers["x-execution"] == "2"
    assert rule_counter(envoy, EDGE_RULE, "outcome_unknown") == 1
    assert rule_counter(envoy, EDGE_RULE, "released") == 1


def refusing_h2_routes(server_port: int) -> Any:
    """``mutate``: the routes above, and the ``H2_REFUSING`` routes to the refusing HTTP/2
    upstream on ``server_port``."""
    def mutate(config: dict) -> None:
        add_routes(config)
        prepend_routes(config, [
            {"name": "edge-h2", "match": {"prefix": H2_REFUSING + "/"},
             "route": {"cluster": "refusing_h2", "timeout": "5s"}},
            {"name": "edge-h2-retried", "match": {"prefix": H2_REFUSING_RETRIED + "/"},
             "route": {"cluster": "refusing_h2", "timeout": "5s",
                       "retry_policy": {"retry_on": "refused-stream,reset,5xx", "num_retries": 2}}},
        ])
        add_h2_cluster(config, "refusing_h2", server_port)
    return mutate


@pytest.mark.parametrize("refusal,route", [("rst", H2_REFUSING), ("goaway", H2_REFUSING),
                                           ("rst", H2_REFUSING_RETRIED)])
def test_a_stream_the_http2_upstream_refused_is_released_and_its_retry_runs(procs, refusal, route) -> None:
    """An HTTP/2 server above its stream limit answers RST_STREAM(REFUSED_STREAM); one going
    away in a rolling restart sends GOAWAY below the stream. Either way the stream provably
    did not run (RFC 9113 8.7): Envoy's 503 (``UR``) frees the key, and the retry with the
    same key executes once, instead of 409 outcome-unknown until the TTL. A route that
    retries refused streams still makes one attempt: the filter caps it."""
    server = start_refusing_h2_server(procs)
    envoy = start_envoy(procs, procs.upstream(), single_proxy_config(), name="envoy-h2-refusing",
                        mutate=refusing_h2_routes(server.port))
    path, key = unique_path(route), new_key()
    request_id = f"refused-{new_key()}"
    first = post(envoy, path, key=key, headers={"x-test-refuse": refusal, "x-request-id": request_id})
    assert first.status_code == 503 and "problem+json" not in first.headers.get("content-type", ""), \
        first.content[:200]
    assert (server.refused(key), server.executions(key)) == (1, 0)
    line = line_for(envoy, request_id)
    assert line["idempotency_outcome"] == "executed+released", line
    assert "UR" in line["flags"].split(","), line
    assert "released: the request never reached the upstream (status 503, flags " in envoy.log_text()
    assert "details upstream_reset_before_response_started{remote_refused_stream_reset}, attempts 1)" \
        in envoy.log_text()
    again = post(envoy, path, key=key)
    assert again.status_code == 201 and again.headers["x-execution"] == "1", again.content[:200]
    assert is_replay(post(envoy, path, key=key))
    assert (server.refused(key), server.executions(key)) == (1, 1)
    assert rule_counter(envoy, EDGE_RULE, "released") == 1
    assert rule_counter(envoy, EDGE_RULE, "outcome_unknown") == 0
    assert not crash_lines(envoy.log_text())


# --------------------------------------------------------------------------
# cluster mode: two Envoys, one store
# --------------------------------------------------------------------------


def cluster_config(**fields: Any) -> dict:
    """envoy/envoy.yaml's plugin configuration, store and all, with the edge rule."""
    config = envoy_yaml_plugin_config()
    config["rules"].append(edge_rule(**fields))
    return config


@pytest.fixture
def replicas(procs: harness.ProcessGroup):
    cluster = start_cluster(procs, envoys=0)
    for name in ("envoy-a", "envoy-b"):
        cluster.add_envoy(name, cluster_config(lease_seconds=1), mutate=add_routes)
    yield cluster
    for envoy in cluster.envoys:
        assert not crash_lines(envoy.log_text())


def test_cluster_a_route_timeout_on_one_replica_is_not_run_again_on_the_other(replicas) -> None:
    a, b = replicas.a, replicas.b
    path, key = unique_path(SLOW_ROUTE), new_key()
    assert cluster_post(a, path, key, headers={"x-demo-delay-ms": "2000"}).status_code == 504
    time.sleep(1.3)
    for envoy in (b, a, b):
        assert_outcome_unknown(cluster_post(envoy, path, key))
    assert replicas.upstream.executions(path) == 1


def test_cluster_a_per_try_timeout_and_a_reset_are_unknown_everywhere(replicas) -> None:
    a, b = replicas.a, replicas.b
    for route, headers, status in ((RETRIED, {"x-demo-delay-ms": "1500"}, 504),
                                   (PLAIN, {"x-demo-reset": "1"}, 503)):
        path, key = unique_path(route), new_key()
        assert cluster_post(a, path, key, headers=headers).status_code == status
        time.sleep(0.7)
        assert_outcome_unknown(cluster_post(b, path, key))
        assert replicas.upstream.executions(path) == 1, route


def test_cluster_a_client_hang_up_is_unknown_on_every_replica(replicas) -> None:
    a, b = replicas.a, replicas.b
    path, key = unique_path(PLAIN), new_key()
    with raw_post(a, path, key, headers={"x-demo-delay-ms": "1500"}) as raw:
        wait_done(replicas.upstream, path)
        raw.abort()
    harness.wait_until(lambda: rule_counter(a, EDGE_RULE, "outcome_unknown") == 1,
                       timeout=10, what="the hang-up recorded")
    # Past the 1 s lease: no replica takes the key over.
    time.sleep(2.0)
    for envoy in (b, a):
        assert_outcome_unknown(cluster_post(envoy, path, key))
    assert replicas.upstream.executions(path) == 1


def test_cluster_a_write_that_outlives_its_lease_is_not_taken_over_by_another_replica(
    replicas,
) -> None:
    """The store's lease is renewed from the first replica while the write runs: a retry
    through the other replica long after the 1 s lease finds it in flight."""
    a, b = replicas.a, replicas.b
    path, key = unique_path(PLAIN), new_key()
    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(cluster_post, a, path, key, headers={"x-demo-delay-ms": "4000"})
        wait_done(replicas.upstream, path)
        for _ in range(3):
            time.sleep(0.9)
            problem(cluster_post(b, path, key), 409, "request-in-flight", rule=EDGE_RULE)
        done = first.result(timeout=20)
    assert done.status_code == 201
    # A's completion reaches the store from its root, just after A's client got the answer.
    replay, _ = wait_for_answer(lambda: cluster_post(b, path, key), timeout=10)
    assert is_replay(replay) and replay.content == done.content
    assert replicas.upstream.executions(path) == 1
    assert rule_counter(b, EDGE_RULE, "taken_over") == 0
    assert rule_counter(a, EDGE_RULE, "lease_lost") == 0


def test_cluster_a_connection_refusal_and_an_upstream_500_can_run_again(replicas) -> None:
    a, b = replicas.a, replicas.b
    refused = unique_path(REFUSED)
    key = new_key()
    assert cluster_post(a, refused, key).status_code == 503
    # A releases the store claim from its root; then B's retry is Envoy's 503, not a 409.
    again, _ = wait_for_answer(lambda: cluster_post(b, refused, key), timeout=10)
    assert again.status_code == 503
    assert rule_counter(b, EDGE_RULE, "released") == 1
    path, key = unique_path(PLAIN), new_key()
    assert cluster_post(a, path, key, headers={"x-demo-status": "500"}).status_code == 500
    again, _ = wait_for_answer(lambda: cluster_post(b, path, key), timeout=10)
    assert again.status_code == 201 and again.headers["x-execution"] == "2"
    assert replicas.upstream.executions(path) == 2


def test_cluster_on_call_sees_the_unknown_outcome_in_the_log_and_the_store(replicas) -> None:
    """The access log names the outcome; ``record show`` says it is unknown with what Envoy
    reported; an operator who reconciled the write purges it, and the key runs again."""
    from test_store_command import record, shown

    a, b = replicas.a, replicas.b
    path, key = unique_path(SLOW_ROUTE), new_key()
    request_id = f"unknown-{new_key()}"
    first = cluster_post(a, path, key, headers={"x-demo-delay-ms": "1500", "x-request-id": request_id})
    assert first.status_code == 504
    line = line_for(a, request_id)
    assert line["idempotency_outcome"] == "executed+outcome_unknown", line
    assert line["flags"] == "UT", line
    harness.wait_until(lambda: record(replicas.store, "show", "--hash", line["idempotency_key_hash"]).returncode == 0,
                       timeout=10, what="the unknown outcome in the store")
    (found,) = shown(replicas.store, "--hash", line["idempotency_key_hash"])
    assert found["state"] == "completed"
    assert found["response"]["outcome"] == "unknown", found
    assert found["response"]["response_flags"] == "UT"
    assert found["response"]["details"] == "response_timeout"
    assert (found["response"]["proxy_status"], found["response"]["attempts"]) == (504, 1)
    text = record(replicas.store, "show", "--hash", line["idempotency_key_hash"]).stdout
    assert "outcome      unknown" in text and "details response_timeout" in text, text
    # Reconciled (the payment did not go through, say): the operator purges it, and a retry
    # through a replica that kept no local copy runs it (docs/operations.md "Worked examples":
    # a purge does not reach the copies Envoys keep locally).
    assert record(replicas.store, "purge", "--hash", line["idempotency_key_hash"]).returncode == 0
    again = cluster_post(b, path, key)
    assert again.status_code == 201 and again.headers["x-execution"] == "2"


def test_make_runs_own_configuration_never_charges_a_payment_twice(procs) -> None:
    """envoy/envoy.yaml as `make run` starts it (two replicas, one store): a client gives up on
    a payment after 1 s while the upstream takes 2 s; its retries, through either replica, are
    told the outcome is unknown, long after the payment rule's lease."""
    cluster = start_cluster(procs)
    path, key = unique_path("payments"), new_key()
    with pytest.raises(client.HTTPError):
        cluster_post(cluster.a, path, key, headers={"x-demo-delay-ms": "2000"}, timeout=1.0)
    wait_done(cluster.upstream, path)
    time.sleep(1.5)
    for envoy in (cluster.b, cluster.a):
        problem(cluster_post(envoy, path, key), 409, "outcome-unknown", rule="payments")
    assert cluster.upstream.executions(path) == 1
    assert rule_counter(cluster.a, "payments", "outcome_unknown") == 1


def test_cluster_an_unknown_outcome_the_store_never_got_is_not_run_again_on_any_worker(
    procs,
) -> None:
    """One worker records the unknown outcome of a client that hung up while the store was
    down; the store's lease lapses before the store is back, so the store calls the key free
    until that worker's queued completion lands. A burst of retries right then, spread over
    both workers, is told, never run; and the record reaches the store (the other Envoy, with
    no local copy, answers 409 too)."""
    cluster = start_cluster(procs, envoys=0)
    for name in ("envoy-a", "envoy-b"):
        cluster.add_envoy(name, cluster_config(lease_seconds=2), mutate=add_routes)
    a, b = cluster.a, cluster.b
    for trial in range(3):
        path, key = unique_path(PLAIN), new_key()
        with raw_post(a, path, key, headers={"x-demo-delay-ms": "1500"}) as raw:
            wait_done(cluster.upstream, path)
            time.sleep(0.3)
            cluster.store.stop()
            time.sleep(0.2)
            raw.abort()
        harness.wait_until(lambda: rule_counter(a, EDGE_RULE, "outcome_unknown") == trial + 1,
                           timeout=10, what="the hang-up recorded")
        time.sleep(2.2)  # the store's 2 s lease, from before the store went down, has passed
        before = worker_connections(a)
        cluster.store.start()
        with ThreadPoolExecutor(max_workers=40) as pool:
            retries = list(pool.map(lambda _: cluster_post(a, path, key), range(40)))
        spread = [now - then for now, then in zip(worker_connections(a), before)]
        assert len(spread) == 2 and min(spread) > 0, f"retries per worker: {spread}"
        statuses = collections.Counter(r.status_code for r in retries)
        assert cluster.upstream.executions(path) == 1, statuses
        assert set(statuses) == {409}, statuses
        for retry in retries:
            assert b"outcome-unknown" in retry.content or b"request-in-flight" in retry.content
        harness.wait_until(
            lambda: b"outcome-unknown" in cluster_post(b, path, key).content, timeout=10,
            what="the other Envoy to find the unknown outcome in the store")
        assert cluster.upstream.executions(path) == 1

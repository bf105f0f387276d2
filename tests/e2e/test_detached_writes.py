"""End-to-end: detached writes (``execution: "detached"``, docs/recipes.md "Finish the write
when the client leaves"). The filter sends a protected write upstream itself, from the
worker's root context, so it completes and is recorded even when its client, or a proxy in
front, gives up first: the retry gets the real result, not "outcome unknown". Every test
counts the demo upstream's executions of its own path.

Envoy from envoy/envoy.yaml, with one detached rule on ``/detached`` (the route's cluster),
and routes of the tests' own: one that rewrites its path and adds a header (what a detached
write gives up), one with a 1 s route timeout (which a detached write does not obey), and a
cluster nobody listens on.
"""

from __future__ import annotations

import json
import socket
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
    new_key,
    post,
    prepend_routes,
    problem,
    rule,
    rule_counter,
    sample_single_proxy_config,
    start_envoy,
    unique_path,
)

DETACHED = "/detached"  # the catch-all route: demo_upstream, 15 s
REWRITTEN = "/detached-rewritten"  # prefix_rewrite to /rewritten/, request_headers_to_add
SHORT = "/detached-short"  # route timeout 1 s
REFUSED = "/detached-refused"  # a cluster whose port nobody listens on
RULE = "detached"


def add_routes(config: dict) -> None:
    prepend_routes(config, [
        {"name": "detached-rewritten", "match": {"prefix": REWRITTEN + "/"},
         "request_headers_to_add": [{"header": {"key": "x-added-by-route", "value": "yes"}}],
         "route": {"cluster": "demo_upstream", "prefix_rewrite": "/rewritten/",
                   "timeout": "15s"}},
        {"name": "detached-short", "match": {"prefix": SHORT + "/"},
         "route": {"cluster": "demo_upstream", "timeout": "1s"}},
        {"name": "detached-refused", "match": {"prefix": REFUSED + "/"},
         "route": {"cluster": "refused", "timeout": "5s"}},
    ])
    config["static_resources"]["clusters"].append({
        "name": "refused",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "refused", "endpoints": [{"lb_endpoints": [{
            "endpoint": {"address": {"socket_address": {
                "address": harness.LOOPBACK, "port_value": harness.free_port()}}}}]}]},
    })


def detached_rule(**fields: Any) -> dict:
    fields.setdefault("execution", "detached")
    return rule(RULE, prefixes=[DETACHED], **fields)


def single_proxy_config(**fields: Any) -> dict:
    config = sample_single_proxy_config()
    config["rules"].insert(0, detached_rule(**fields))
    return config


def wait_started(upstream: harness.Upstream, path: str, executions: int = 1) -> None:
    """The upstream has started the write (it counts before any delay)."""
    harness.wait_until(lambda: upstream.executions(path) >= executions, timeout=10,
                       what=f"{executions} execution(s) of {path}")


@pytest.fixture
def edge(procs: harness.ProcessGroup) -> Iterator[tuple[harness.Envoy, harness.Upstream]]:
    upstream = procs.upstream()
    envoy = start_envoy(procs, upstream, single_proxy_config(), name="envoy-detached",
                        mutate=add_routes)
    yield envoy, upstream
    assert not crash_lines(envoy.log_text(), vm_failures=True)


# --------------------------------------------------------------------------
# single-proxy mode
# --------------------------------------------------------------------------


def test_a_client_that_hangs_up_gets_the_real_response_when_it_retries(edge) -> None:
    """The case: a client gives up on a payment before the upstream answers. Inline, the
    retry is told "outcome unknown"; detached, the write completed and was recorded, and the
    retry replays it."""
    envoy, upstream = edge
    path, key = unique_path(DETACHED), new_key()
    with raw_post(envoy, path, key, headers={"x-demo-delay-ms": "2000"}) as raw:
        wait_started(upstream, path)
        raw.abort()
    # Still running: a retry now waits its turn (409, Retry-After), it never runs it again.
    problem(cluster_post(envoy, path, key), 409, "request-in-flight", rule=RULE)
    replay, _ = wait_for_answer(lambda: cluster_post(envoy, path, key), timeout=10)
    assert replay.status_code == 201, replay.content[:300]
    assert is_replay(replay)
    doc = json.loads(replay.content)
    assert doc["execution"] == 1 and doc["path"] == path, doc
    assert upstream.executions(path) == 1
    assert rule_counter(envoy, RULE, "completed_after_client_left") == 1
    assert rule_counter(envoy, RULE, "outcome_unknown") == 0


def test_a_client_that_waits_gets_the_upstreams_answer_and_a_retry_the_replay(edge) -> None:
    envoy, upstream = edge
    path, key = unique_path(DETACHED), new_key()
    first = post(envoy, path, key=key, headers={"x-demo-header": "set-cookie=s=1",
                                                "x-demo-delay-ms": "200"})
    assert first.status_code == 201 and not is_replay(first), first.content[:300]
    assert first.headers.get("set-cookie") == "s=1", "the client gets the whole response"
    assert first.headers["content-type"] == "application/json"
    again = post(envoy, path, key=key)
    assert is_replay(again) and again.content == first.content
    assert upstream.executions(path) == 1
    assert rule_counter(envoy, RULE, "detached") == 1


def test_what_the_upstream_receives_and_what_a_detached_write_gives_up(edge) -> None:
    """The upstream gets the request's own headers and the ones Envoy's connection manager
    added before the filter (x-request-id, x-forwarded-proto), with the original method, path
    and body; not what the router would have done: the route's prefix_rewrite and
    request_headers_to_add are not applied, nor are the hop-by-hop headers passed on."""
    envoy, upstream = edge
    path, key = unique_path(REWRITTEN), new_key()
    resp = post(envoy, path, key=key, headers={"x-demo-echo": "1", "x-request-id": "req-42",
                                               "x-client-header": "kept"})
    assert resp.status_code == 201, resp.content[:300]
    doc = json.loads(resp.content)
    seen = doc["headers"]
    assert doc["path"] == path, "the route's prefix_rewrite is not applied"
    assert upstream.executions(path) == 1
    assert seen["x-request-id"] == "req-42"
    assert seen["x-client-header"] == "kept"
    assert seen["idempotency-key"] == key
    assert seen["x-forwarded-proto"] == "http"
    assert "x-added-by-route" not in seen, "the route's request_headers_to_add is not applied"
    # Envoy's callout announces its own timeout (the rule's upstream_timeout_ms) and marks
    # itself internal.
    assert seen["x-envoy-expected-rq-timeout-ms"] == "15000"
    assert seen["x-envoy-internal"] == "true"
    assert seen["content-length"] == str(doc["body_bytes"])


def test_a_chunked_request_with_trailers_goes_on_whole(edge) -> None:
    """A request without content-length (chunked, with a trailer) is sent on with its body,
    counted, and its trailer; the chunked framing is the callout's own."""
    envoy, upstream = edge
    path, key = unique_path(DETACHED), new_key()
    body = b'{"amount": 100}'
    head = (f"POST {path} HTTP/1.1\r\nHost: api.test\r\nidempotency-key: {key}\r\n"
            "content-type: application/json\r\nx-demo-echo: 1\r\n"
            "transfer-encoding: chunked\r\nconnection: close\r\n\r\n").encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\nx-checksum: abc\r\n\r\n"
    with socket.create_connection((harness.LOOPBACK, envoy.port), timeout=10) as sock:
        sock.sendall(head + chunked)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 201 " in status_line, answer[:300]
    doc = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert doc["body_bytes"] == len(body)
    assert doc["headers"].get("content-length") == str(len(body)), doc["headers"]
    assert "transfer-encoding" not in doc["headers"], doc["headers"]
    assert upstream.executions(path) == 1


def test_the_rules_own_timeout_governs_not_the_routes(edge) -> None:
    """The route times out after 1 s; a detached write is not the router's, so a 2 s write
    on that route completes and the client gets it (the rule's upstream_timeout_ms, 15 s by
    default, bounds it instead)."""
    envoy, upstream = edge
    path, key = unique_path(SHORT), new_key()
    resp = post(envoy, path, key=key, headers={"x-demo-delay-ms": "2000"})
    assert resp.status_code == 201, resp.content[:300]
    assert upstream.executions(path) == 1


def test_a_refused_connection_frees_the_key(edge) -> None:
    """Nothing reached an upstream: Envoy's 503 goes to the client, and a retry is sent
    again (and refused again), never answered 409."""
    envoy, _ = edge
    path, key = unique_path(REFUSED), new_key()
    for attempt in (1, 2):
        resp = post(envoy, path, key=key)
        assert resp.status_code == 503, resp.content[:300]
        assert b"upstream connect error" in resp.content, resp.content[:300]
        assert rule_counter(envoy, RULE, "released") == attempt
    assert rule_counter(envoy, RULE, "outcome_unknown") == 0


def test_a_detached_write_past_its_timeout_is_an_unknown_outcome_never_run_twice(procs) -> None:
    upstream = procs.upstream()
    envoy = start_envoy(procs, upstream, single_proxy_config(upstream_timeout_ms=1000),
                        name="envoy-detached-timeout", mutate=add_routes)
    path, key = unique_path(DETACHED), new_key()
    first = post(envoy, path, key=key, headers={"x-demo-delay-ms": "2000"})
    assert first.status_code == 504 and first.content == b"upstream request timeout", first.content[:300]
    time.sleep(1.3)  # the upstream finished meanwhile
    for _ in range(2):
        problem(post(envoy, path, key=key), 409, "outcome-unknown", rule=RULE)
    assert upstream.executions(path) == 1
    assert rule_counter(envoy, RULE, "outcome_unknown") == 1
    assert not crash_lines(envoy.log_text(), vm_failures=True)


def test_wait_mode_duplicates_held_meanwhile_get_its_response(procs) -> None:
    upstream = procs.upstream()
    envoy = start_envoy(procs, upstream, single_proxy_config(on_in_flight="wait", wait_ms=5000),
                        name="envoy-detached-wait", mutate=add_routes)
    path, key = unique_path(DETACHED), new_key()
    with raw_post(envoy, path, key, headers={"x-demo-delay-ms": "1500"}) as raw:
        wait_started(upstream, path)
        raw.abort()
    with ThreadPoolExecutor(max_workers=3) as pool:
        held = [pool.submit(cluster_post, envoy, path, key) for _ in range(3)]
        answers = [f.result(timeout=20) for f in held]
    first = json.loads(answers[0].content)
    for resp in answers:
        assert resp.status_code == 201 and is_replay(resp), resp.content[:300]
        assert resp.content == answers[0].content
    assert first["execution"] == 1
    assert upstream.executions(path) == 1
    assert rule_counter(envoy, RULE, "replayed_after_wait") == 3
    assert not crash_lines(envoy.log_text(), vm_failures=True)

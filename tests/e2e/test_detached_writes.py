"""End-to-end: detached writes (``execution: "detached"``, docs/detached-writes.md). The filter sends a protected write upstream itself, from the
worker's root context, so it completes and is recorded even when its client, or a proxy in
front, gives up first: the retry gets the real result, not "outcome unknown". Every test
counts the demo upstream's executions of its own path.

Envoy from envoy/envoy.yaml, with one detached rule on ``/detached`` (the route's cluster),
and routes of the tests' own: one that rewrites its path and adds a header (what a detached
write gives up), one with a 1 s route timeout (which a detached write does not obey), and a
cluster nobody listens on.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import pytest

import client
import harness
from cluster import raw_post, start_cluster, wait_for_answer
from cluster import post as cluster_post
from helpers import (
    needs_route_cluster,
    crash_lines,
    envoy_yaml_plugin_config,
    is_replay,
    new_key,
    post,
    add_refused_cluster,
    prepend_routes,
    problem,
    rule,
    rule_counter,
    sample_single_proxy_config,
    start_envoy,
    unique_path,
)

# Every rule here takes its cluster from the route.
pytestmark = [needs_route_cluster]

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
    add_refused_cluster(config)


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


def detached_envoy(procs: harness.ProcessGroup, name: str, mutate: Callable[[dict], None] = add_routes,
                   **fields: Any) -> tuple[harness.Envoy, harness.Upstream]:
    """An upstream, and an Envoy with the test routes (or what ``mutate`` makes of
    envoy.yaml) whose detached rule has ``fields``."""
    upstream = procs.upstream()
    envoy = start_envoy(procs, upstream, single_proxy_config(**fields), name=name, mutate=mutate)
    return envoy, upstream


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
    # itself internal; the filter says what Envoy had decided for the original, and caps the
    # router at no retry.
    assert seen["x-envoy-expected-rq-timeout-ms"] == "15000"
    assert seen["x-envoy-internal"] == "true"
    assert seen["x-idempotency-original-internal"] == "false"
    assert seen["content-length"] == str(doc["body_bytes"])


INTERNAL_CLIENT = "127.0.0.2"  # the address the edge Envoy below treats as internal


def hcm_of(config: dict) -> dict:
    return next(f["typed_config"] for listener in config["static_resources"]["listeners"]
                for chain in listener["filter_chains"] for f in chain["filters"]
                if f["name"] == "envoy.filters.network.http_connection_manager")


def as_edge(config: dict) -> None:
    """``mutate``: the test routes, and the connection manager of an edge proxy that trusts
    the client's address (``use_remote_address``) and treats only INTERNAL_CLIENT as internal,
    so that a client on 127.0.0.1 is external and one on 127.0.0.2 internal. Envoy lets an
    internal client's ``x-envoy-*`` headers through to the filters and the router."""
    add_routes(config)
    hcm = hcm_of(config)
    hcm["use_remote_address"] = True
    hcm["internal_address_config"] = {"cidr_ranges": [{"address_prefix": INTERNAL_CLIENT, "prefix_len": 32}]}


def as_edge_with_internal_mark_restored(config: dict) -> None:
    """``mutate``: ``as_edge``, and on demo_upstream the upstream filter of
    docs/detached-writes.md that puts the original request's internal mark back in
    ``x-envoy-internal`` (Envoy's callout sets it to true on every copy)."""
    as_edge(config)
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "demo_upstream")
    cluster["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http_protocol_options": {}},
        "http_filters": [
            {"name": "envoy.filters.http.header_mutation", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                "mutations": {"request_mutations": [
                    {"append": {"header": {"key": "x-envoy-internal",
                                           "value": "%REQ(x-idempotency-original-internal)%"},
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}},
                    {"remove": "x-idempotency-original-internal"},
                ]}}},
            {"name": "envoy.filters.http.upstream_codec", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"}},
        ],
    }}


def post_from(envoy: harness.Envoy, source: str, path: str, key: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """A POST from the loopback address ``source``: status and body."""
    conn = http.client.HTTPConnection(harness.LOOPBACK, envoy.port, timeout=20, source_address=(source, 0))
    try:
        conn.request("POST", path, body=b'{"amount": 100}',
                     headers={"host": "api.test", "idempotency-key": key, "content-type": "application/json",
                              **headers})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_an_internal_clients_router_headers_do_not_resend_a_detached_write(procs) -> None:
    """A caller Envoy treats as internal may steer its router with x-envoy-* headers. A
    detached write's copy carries none of them: asked for three retries after 200 ms per try,
    the 500 ms write runs once and its answer reaches the client."""
    envoy, upstream = detached_envoy(procs, "envoy-detached-edge", mutate=as_edge)
    path, key = unique_path(DETACHED), new_key()
    status, body = post_from(envoy, INTERNAL_CLIENT, path, key, {
        "x-demo-delay-ms": "500", "x-envoy-retry-on": "gateway-error,5xx,reset",
        "x-envoy-max-retries": "3", "x-envoy-upstream-rq-per-try-timeout-ms": "200",
        "x-envoy-hedge-on-per-try-timeout": "true"})
    assert status == 201, body[:300]
    time.sleep(1.0)  # room for any retry the router would have sent
    assert upstream.executions(path) == 1
    assert rule_counter(envoy, RULE, "outcome_unknown") == 0


def test_an_internal_client_cannot_lift_the_rules_timeout(procs) -> None:
    """``x-envoy-upstream-rq-timeout-ms: 0`` (no timeout, to the router) from an internal
    caller: the rule's 1 s upstream_timeout_ms still ends a 2 s write, as an unknown outcome."""
    envoy, upstream = detached_envoy(procs, "envoy-detached-edge-timeout", mutate=as_edge, upstream_timeout_ms=1000)
    path, key = unique_path(DETACHED), new_key()
    status, body = post_from(envoy, INTERNAL_CLIENT, path, key, {
        "x-demo-delay-ms": "2000", "x-envoy-upstream-rq-timeout-ms": "0"})
    assert status == 504 and body == b"upstream request timeout", (status, body[:300])
    assert rule_counter(envoy, RULE, "outcome_unknown") == 1
    assert upstream.executions(path) == 1


def test_the_upstream_filter_of_the_docs_gives_an_external_clients_copy_no_internal_mark(procs) -> None:
    """Envoy's callout marks every copy ``x-envoy-internal: true``; the filter says on the copy
    what Envoy had decided for the original, and the cluster's upstream filter from
    docs/detached-writes.md puts that back. Routed requests on the same cluster keep Envoy's own
    mark."""
    envoy, _ = detached_envoy(procs, "envoy-detached-mark", mutate=as_edge_with_internal_mark_restored)

    def seen(source: str, prefix: str) -> dict:
        status, body = post_from(envoy, source, unique_path(prefix), new_key(), {"x-demo-echo": "1"})
        assert status == 201, body[:300]
        return json.loads(body)["headers"]

    external, internal = seen(harness.LOOPBACK, DETACHED), seen(INTERNAL_CLIENT, DETACHED)
    assert external.get("x-envoy-internal") == "false", external
    assert internal.get("x-envoy-internal") == "true", internal
    assert "x-idempotency-original-internal" not in external and "x-idempotency-original-internal" not in internal
    routed_internal = seen(INTERNAL_CLIENT, "/unprotected")
    assert routed_internal.get("x-envoy-internal") == "true", routed_internal
    assert "x-envoy-internal" not in seen(harness.LOOPBACK, "/unprotected")


def add_filter_after_ours(config: dict) -> None:
    """``mutate``: the test routes, and a header_mutation filter between the idempotency
    filter and the router that adds a request header, as other filters of a chain would."""
    add_routes(config)
    hcm = next(f["typed_config"] for listener in config["static_resources"]["listeners"]
               for chain in listener["filter_chains"] for f in chain["filters"]
               if f["name"] == "envoy.filters.network.http_connection_manager")
    router_at = next(i for i, f in enumerate(hcm["http_filters"]) if f["name"] == "envoy.filters.http.router")
    hcm["http_filters"].insert(router_at, {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"append": {"header": {
                "key": "x-added-by-later-filter", "value": "yes"}}}]},
        },
    })


def test_filters_after_this_one_do_not_see_a_detached_write(procs) -> None:
    """A detached write leaves the filter chain at this filter: a later filter (here one that
    adds a request header) runs for inline requests and not for detached ones. And repeated
    response headers reach the client of a detached write as Envoy's local replies carry
    them."""
    upstream = procs.upstream()
    config = single_proxy_config()
    config["rules"].append(rule("inline", prefixes=["/inline"]))
    envoy = start_envoy(procs, upstream, config, name="envoy-detached-chain", mutate=add_filter_after_ours)
    inline = post(envoy, unique_path("/inline"), key=new_key(), headers={"x-demo-echo": "1"})
    assert json.loads(inline.content)["headers"].get("x-added-by-later-filter") == "yes"
    detached = client.post(envoy.url(unique_path(DETACHED)), body=b"{}", timeout=10, headers=[
        ("Host", "api.test"), ("idempotency-key", new_key()), ("content-type", "application/json"),
        ("x-demo-echo", "1"), ("x-demo-header", "set-cookie=a=1"), ("x-demo-header", "set-cookie=b=2")])
    assert detached.status_code == 201
    assert "x-added-by-later-filter" not in json.loads(detached.content)["headers"]
    assert detached.headers.get_list("set-cookie") == ["a=1", "b=2"]
    assert not crash_lines(envoy.log_text(), vm_failures=True)


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
    envoy, upstream = detached_envoy(procs, "envoy-detached-timeout", upstream_timeout_ms=1000)
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
    envoy, upstream = detached_envoy(procs, "envoy-detached-wait", on_in_flight="wait", wait_ms=5000)
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


def test_a_response_over_max_response_bytes_reaches_the_client_without_its_body(procs) -> None:
    """A detached write's response is read up to the rule's max_response_bytes: a larger one
    reaches the client, and its retries, with its status and headers and the body-omitted
    marker, never a second execution."""
    envoy, upstream = detached_envoy(procs, "envoy-detached-large", max_response_bytes=1024)
    path, key = unique_path(DETACHED), new_key()
    first = post(envoy, path, key=key, headers={"x-demo-body-bytes": "65536"})
    assert first.status_code == 201 and first.content == b"", first.content[:100]
    assert first.headers["idempotent-body-omitted"] == "true"
    again = post(envoy, path, key=key)
    assert again.status_code == 201 and is_replay(again)
    assert again.headers["idempotent-body-omitted"] == "true"
    assert upstream.executions(path) == 1
    assert not crash_lines(envoy.log_text(), vm_failures=True)


def test_a_cluster_envoy_does_not_know_frees_the_key_and_says_so(procs) -> None:
    """A detached rule naming a cluster Envoy does not have (a typo, a cluster not pushed
    yet): Envoy refuses each callout, so nothing runs; the client gets 503 problem+json and
    the log names the cluster."""
    envoy, upstream = detached_envoy(procs, "envoy-detached-typo", upstream_cluster="no-such-cluster")
    path, key = unique_path(DETACHED), new_key()
    for attempt in (1, 2):
        problem(post(envoy, path, key=key), 503, "idempotency-unavailable", rule=RULE)
        assert rule_counter(envoy, RULE, "released") == attempt
    assert upstream.executions(path) == 0
    assert "Envoy refused the callout to cluster 'no-such-cluster'" in envoy.log_text()
    assert not crash_lines(envoy.log_text(), vm_failures=True)


# --------------------------------------------------------------------------
# retriers users put in front: a front Envoy, the Stripe SDK, nginx over two replicas
# --------------------------------------------------------------------------


def front_envoy_config(per_try_timeout: str) -> dict:
    """A plain Envoy (no filter) in front of the filter's, retrying the way gateways do: on a
    5xx or no answer within ``per_try_timeout``, a few times."""
    return {
        "admin": {"address": {"socket_address": {"address": harness.LOOPBACK, "port_value": 0}}},
        "static_resources": {
            "listeners": [{
                "name": "front",
                "address": {"socket_address": {"address": harness.LOOPBACK, "port_value": 0}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                 "http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "front",
                        "route_config": {"virtual_hosts": [{
                            "name": "all", "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"}, "route": {
                                "cluster": "backend", "timeout": "20s",
                                "retry_policy": {"retry_on": "5xx,reset", "num_retries": 5,
                                                 "per_try_timeout": per_try_timeout}}}]}]},
                        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
                    },
                }]}],
            }],
            "clusters": [{
                "name": "backend", "type": "STATIC", "connect_timeout": "1s",
                "load_assignment": {"cluster_name": "backend", "endpoints": [{"lb_endpoints": [{
                    "endpoint": {"address": {"socket_address": {
                        "address": harness.LOOPBACK, "port_value": 0}}}}]}]},
            }],
        },
    }


@pytest.mark.parametrize("on_in_flight", ["wait", "conflict"])
def test_a_front_envoys_per_try_timeout_retry_gets_the_real_response(procs, on_in_flight) -> None:
    """A front Envoy gives up on each try after 0.8 s and retries; the write takes 2 s. Its
    first try's hang-up does not stop the detached write. In wait mode a later try is held
    until the write completes and gets its response; without, a try gets 409 (which the front
    does not retry) and the client's own later retry gets the response. One execution."""
    fields = {"on_in_flight": "wait", "wait_ms": 5000} if on_in_flight == "wait" else {}
    upstream = procs.upstream()
    envoy = start_envoy(procs, upstream, single_proxy_config(**fields),
                        name=f"envoy-detached-behind-front-{on_in_flight}", mutate=add_routes)
    front = procs.envoy(front_envoy_config("0.8s"), cluster_ports={"backend": envoy.port},
                        name=f"front-envoy-{on_in_flight}")
    path, key = unique_path(DETACHED), new_key()
    headers = {"Host": "api.test", "idempotency-key": key, "content-type": "application/json"}
    first = client.post(front.url(path), body=b'{"amount":100}',
                        headers={**headers, "x-demo-delay-ms": "2000"}, timeout=20)
    retries = front.stat("cluster.backend.upstream_rq_retry")
    assert retries >= 1, "the front Envoy did retry"
    if on_in_flight == "wait":
        assert first.status_code == 201 and is_replay(first), (first.status_code, first.content[:300])
        done = first
    else:
        problem(first, 409, "request-in-flight", rule=RULE)
        done, _ = wait_for_answer(
            lambda: client.post(front.url(path), body=b'{"amount":100}', headers=headers, timeout=20),
            timeout=10)
        assert done.status_code == 201 and is_replay(done), done.content[:300]
    assert json.loads(done.content)["execution"] == 1
    assert upstream.executions(path) == 1
    assert rule_counter(envoy, RULE, "completed_after_client_left") == 1
    assert rule_counter(envoy, RULE, "outcome_unknown") == 0
    assert not crash_lines(envoy.log_text(), vm_failures=True)


def test_the_stripe_sdk_that_times_out_gets_the_real_payment_intent(procs) -> None:
    """The Stripe Python SDK with a 1 s timeout and retries, against a 2 s write: inline, it
    ends with APIError(409) outcome-unknown (test_retrying_clients.py); detached and in wait
    mode, its retry (same key, same body) is held until the write completes and the SDK
    returns the real PaymentIntent. One execution."""
    import stripe

    from test_retrying_clients import API_KEY, INTENTS, PARAMS, RecordingClient, assert_one_key_one_body

    upstream = procs.upstream()
    config = sample_single_proxy_config()
    config["rules"].insert(0, rule("stripe", prefixes=[INTENTS], execution="detached",
                                   on_in_flight="wait", wait_ms=5000))
    envoy = start_envoy(procs, upstream, config, name="envoy-detached-stripe")
    http = RecordingClient(1.0)
    sdk = stripe.StripeClient(API_KEY, base_addresses={"api": f"http://{harness.LOOPBACK}:{envoy.port}"},
                              max_network_retries=3, http_client=http)
    intent = sdk.v1.payment_intents.create(params=PARAMS, options={"headers": {"x-demo-delay-ms": "2000"}})
    summary = http.summary()
    assert_one_key_one_body(http)
    first, *retries = http.attempts
    assert first.error and "Read timed out" in first.error, summary
    assert retries and retries[-1].status == 201, summary
    assert intent["execution"] == 1 and intent["path"] == INTENTS, intent
    assert intent.last_response.headers.get("idempotent-replayed") == "true"
    assert upstream.executions(INTENTS) == 1
    assert rule_counter(envoy, "stripe", "completed_after_client_left") == 1
    assert not crash_lines(envoy.log_text(), vm_failures=True)


def test_nginx_resending_a_timed_out_post_to_the_other_replica_runs_it_once_and_replays(procs) -> None:
    """Cluster mode, two replicas sharing a store, nginx in front re-sending a POST that timed
    out after 1 s to the other replica (``proxy_next_upstream error timeout non_idempotent``).
    The first replica's detached write completes after nginx left and lands in the store; the
    second replica answered nginx's re-send 409 meanwhile; the client's later retries, through
    nginx or straight to either replica, replay the real response. One execution."""
    from test_retrying_clients import LB_DIRECTIVES

    from cluster import BODY, cluster_plugin_config

    plugin = cluster_plugin_config(timeout_ms=2000, extra_rules=[detached_rule()])
    cluster = start_cluster(procs, plugin=plugin)
    ports = [e.port for e in cluster.envoys]
    lb = procs.nginx(servers=ports, server_params="max_fails=0", proxy_directives=LB_DIRECTIVES)
    path, key = unique_path(DETACHED), new_key()
    headers = {"idempotency-key": key, "content-type": "application/json"}
    first = client.post(lb.url(path), body=BODY, headers={**headers, "x-demo-delay-ms": "2500"},
                        timeout=10)
    entry = harness.wait_until(lambda: next((e for e in lb.access_entries()
                                             if e["request"].startswith(f"POST {path} ")), None),
                               timeout=5, what="nginx's access log line")
    assert len(entry["upstream_addr"].split(",")) == 2, entry  # nginx re-sent it
    problem(first, 409, "request-in-flight", rule=RULE)
    replay, _ = wait_for_answer(lambda: client.post(lb.url(path), body=BODY, headers=headers, timeout=10),
                                timeout=10)
    assert replay.status_code == 201 and is_replay(replay), replay.content[:300]
    for envoy in cluster.envoys:
        again = cluster_post(envoy, path, key)
        assert again.status_code == 201 and is_replay(again) and again.content == replay.content
    assert json.loads(replay.content)["execution"] == 1
    assert cluster.upstream.executions(path) == 1
    counters = [rule_counter(e, RULE, "completed_after_client_left") for e in cluster.envoys]
    assert sum(counters) == 1, counters
    for envoy in cluster.envoys:
        assert not crash_lines(envoy.log_text(), vm_failures=True), envoy.name


def test_cluster_a_hang_up_on_one_replica_replays_on_the_other(procs) -> None:
    plugin = envoy_yaml_plugin_config()
    plugin["rules"].insert(0, detached_rule())
    cluster = start_cluster(procs, plugin=plugin)
    a, b = cluster.a, cluster.b
    path, key = unique_path(DETACHED), new_key()
    with raw_post(a, path, key, headers={"x-demo-delay-ms": "1500"}) as raw:
        wait_started(cluster.upstream, path)
        raw.abort()
    problem(cluster_post(b, path, key), 409, "request-in-flight", rule=RULE)
    replay, _ = wait_for_answer(lambda: cluster_post(b, path, key), timeout=10)
    assert replay.status_code == 201 and is_replay(replay), replay.content[:300]
    assert json.loads(replay.content)["execution"] == 1
    assert cluster.upstream.executions(path) == 1


# --------------------------------------------------------------------------
# the README's recipe, as users copy it
# --------------------------------------------------------------------------


def readme_payment_recipe() -> dict:
    section = (harness.REPO_ROOT / "README.md").read_text().split(
        "\n## Recipe: a payment that finishes when its client leaves\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"^```json\n(.*?)^```", section, re.S | re.M)
    return json.loads(block)


def test_the_readmes_payment_recipe_gives_a_phone_that_gave_up_the_real_charge(procs) -> None:
    """The README's recipe on envoy/envoy.yaml's /payments route: the phone gives up after
    0.8 s, the payment takes 2 s; its retry 0.2 s later is held until the charge completes and
    gets it. One charge."""
    upstream = procs.upstream()
    envoy = start_envoy(procs, upstream, readme_payment_recipe(), name="envoy-readme-payments")
    path, key = unique_path("payments"), new_key()
    with pytest.raises(client.HTTPError):
        cluster_post(envoy, path, key, headers={"x-demo-delay-ms": "2000"}, timeout=0.8)
    time.sleep(0.2)
    retry = cluster_post(envoy, path, key, timeout=10)
    assert retry.status_code == 201 and is_replay(retry), retry.content[:300]
    assert json.loads(retry.content)["execution"] == 1
    assert upstream.executions(path) == 1
    assert rule_counter(envoy, "payments", "completed_after_client_left") == 1
    assert not crash_lines(envoy.log_text(), vm_failures=True)

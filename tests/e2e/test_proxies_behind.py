"""End-to-end: a proxy behind the filter's Envoy gives up while the write goes on
(docs/guarantees.md "A proxy behind the upstream that gives up").

The chains, each through real processes on loopback:

- **sidecar**: client -> Envoy with the filter (envoy/envoy.yaml) -> a plain Envoy with a 1 s
  route timeout, as a service's sidecar in a mesh -> the demo upstream;
- **nginx**: the same with nginx (``proxy_read_timeout 1s``) in the middle;
- **grpc**: grpcio's client -> Envoy with the filter (envoy/envoy-grpc.yaml) -> a plain Envoy
  speaking HTTP/2 with a 1 s route timeout -> the grpcio server.

The proxy in the middle answers the filter's Envoy itself (504, 502, 503 with Envoy's words,
gRPC UNAVAILABLE) while the service completes the write. Each test counts the executions at
the service: one, over retries at once, after the write completed and after the lease. With
``resolve`` the retry gets the write's real result. A proxy's answer that proves the request
never reached the service, and the service's own 503 with ``Retry-After``, release the key:
the retry runs, once.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import grpc
import pytest

import client
import grpc_calls
import harness
from helpers import (
    needs_route_cluster,
    crash_lines,
    is_replay,
    new_key,
    post,
    problem,
    rule,
    rule_counter,
    envoy_options,
    sample_single_proxy_config,
    unique_path,
)

BEHIND = "/behind"  # the rule without resolve
RESOLVED = "/resolved-behind"  # the rule with resolve
RULE, RESOLVED_RULE = "behind", "behind-resolved"
LEASE_SECONDS = 3
SETTLE_SECONDS = 2
CALLER = {"authorization": "Bearer alice"}
# The service's write outlives the proxy's 1 s timeout, and completes.
WRITE_MS = 2500
PROXY_TIMEOUT = "1s"


def plugin_config() -> dict:
    config = sample_single_proxy_config()
    config["rules"][:0] = [
        rule(RULE, prefixes=[BEHIND], lease_seconds=LEASE_SECONDS),
        rule(RESOLVED_RULE, prefixes=[RESOLVED], lease_seconds=LEASE_SECONDS,
             resolve={"path": "/payments/by-key/{key}", "settle_seconds": SETTLE_SECONDS,
                      "backoff_seconds": 1}),
    ]
    return config


def sidecar_config(cluster: str, *, http2: bool = False) -> dict:
    """A plain Envoy (no filter) with a 1 s route timeout to ``cluster``: a service's sidecar."""
    config = harness.router_config(cluster, route_timeout=PROXY_TIMEOUT)
    if http2:
        config["static_resources"]["clusters"][0]["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return config


def start_sidecar(procs: harness.ProcessGroup, port: int, cluster: str = "demo_upstream",
                  **kwargs: Any) -> harness.Envoy:
    return procs.envoy(sidecar_config(cluster, **kwargs), cluster_ports={cluster: port},
                       name="sidecar", build="wasm")


def start_nginx(procs: harness.ProcessGroup, port: int) -> harness.Nginx:
    return procs.nginx(servers=[port], name="nginx-behind", proxy_directives=[
        f"proxy_read_timeout {PROXY_TIMEOUT};",
        "proxy_http_version 1.1;",
        'proxy_set_header Connection "";',
    ])


def edge_envoy(procs: harness.ProcessGroup, middle_port: int, config: dict | None = None) -> harness.Envoy:
    """Envoy with the filter (envoy/envoy.yaml), its demo cluster sent to the proxy in the
    middle on ``middle_port``."""
    options = envoy_options(harness.Upstream(None, middle_port), config or plugin_config())
    return procs.envoy(harness.default_envoy_config(), name="envoy-edge", **options)


@pytest.fixture(params=["sidecar", "nginx"])
def chain(request, procs: harness.ProcessGroup) -> Iterator[tuple[harness.Envoy, harness.Upstream]]:
    upstream = procs.upstream()
    middle = (start_sidecar(procs, upstream.port) if request.param == "sidecar"
              else start_nginx(procs, upstream.port))
    envoy = edge_envoy(procs, middle.port)
    yield envoy, upstream
    assert not crash_lines(envoy.log_text())


def pay(envoy: harness.Envoy, path: str, key: str, **headers: str) -> client.Response:
    return post(envoy, path, key=key, headers={**CALLER, **headers})


def assert_outcome_unknown(resp: client.Response, rule_name: str = RULE) -> None:
    problem(resp, 409, "outcome-unknown", rule=rule_name)
    assert not is_replay(resp)


def test_a_proxys_timeout_while_the_write_completes_never_runs_it_again(chain) -> None:
    envoy, upstream = chain
    path, key = unique_path(BEHIND), new_key()
    first = pay(envoy, path, key, **{"x-demo-delay-ms": str(WRITE_MS)})
    assert first.status_code == 504, first.content[:200]
    # Retries at once, several together.
    with ThreadPoolExecutor(max_workers=4) as pool:
        for resp in pool.map(lambda _: pay(envoy, path, key), range(4)):
            assert_outcome_unknown(resp)
    # Once the write completed behind the proxy, and past the lease.
    harness.wait_until(lambda: upstream.executions(path) == 1, timeout=10, what="the write")
    time.sleep(WRITE_MS / 1000)
    assert_outcome_unknown(pay(envoy, path, key))
    time.sleep(LEASE_SECONDS + 0.5)
    assert_outcome_unknown(pay(envoy, path, key))
    assert upstream.executions(path) == 1
    assert rule_counter(envoy, RULE, "outcome_unknown") == 1
    assert rule_counter(envoy, RULE, "released") == 0


@needs_route_cluster
def test_a_proxys_timeout_converges_with_resolve_to_the_writes_result(chain) -> None:
    envoy, upstream = chain
    path, key = unique_path(RESOLVED), new_key()
    first = pay(envoy, path, key, **{"x-demo-delay-ms": str(WRITE_MS)})
    assert first.status_code == 504, first.content[:200]
    early = pay(envoy, path, key)
    problem(early, 409, "outcome-unknown", rule=RESOLVED_RULE)
    assert "retry-after" in early.headers, dict(early.headers)
    deadline = time.monotonic() + 20
    while (resp := pay(envoy, path, key)).status_code == 409:
        assert time.monotonic() < deadline, "still unknown"
        time.sleep(0.3)
    # The lookup's answer: the payment the write made, behind the proxy, once.
    assert resp.status_code == 200, resp.content[:200]
    assert resp.json()["path"] == path and resp.json()["execution"] == 1, resp.content[:200]
    assert is_replay(resp) and resp.headers["idempotent-resolved"] == "true", dict(resp.headers)
    assert upstream.executions(path) == 1
    assert rule_counter(envoy, RESOLVED_RULE, "outcome_unknown") == 1


def test_a_reset_after_sending_answered_by_the_proxy_is_unknown(chain) -> None:
    """The service reads the request, does the write and drops the connection: the sidecar
    answers 503 with Envoy's words for a reset after sending, nginx 502."""
    envoy, upstream = chain
    path, key = unique_path(BEHIND), new_key()
    first = pay(envoy, path, key, **{"x-demo-reset": "1"})
    assert first.status_code in (502, 503), first.content[:200]
    assert_outcome_unknown(pay(envoy, path, key))
    assert upstream.executions(path) == 1


def test_the_services_own_503_with_retry_after_releases_and_the_retry_runs_once(chain) -> None:
    envoy, upstream = chain
    path, key = unique_path(BEHIND), new_key()
    busy = pay(envoy, path, key, **{"x-demo-status": "503", "x-demo-header": "retry-after=1"})
    assert busy.status_code == 503 and busy.headers.get("retry-after") == "1", busy.content[:200]
    done = pay(envoy, path, key)
    assert done.status_code == 201 and not is_replay(done), done.content[:200]
    again = pay(envoy, path, key)
    assert is_replay(again) and again.content == done.content
    assert upstream.executions(path) == 2, "the 503, then the one run that took effect"
    assert rule_counter(envoy, RULE, "released") == 1
    assert rule_counter(envoy, RULE, "outcome_unknown") == 0


def test_a_sidecar_that_could_not_connect_releases_and_the_retry_runs_once_it_is_back(procs) -> None:
    """The sidecar's service is not listening yet: the sidecar answers 503 with Envoy's words
    for a refused connection, which prove nothing ran. Once the service is up the retry runs,
    once, and its retry is a replay."""
    port = harness.free_port()
    sidecar = start_sidecar(procs, port)
    envoy = edge_envoy(procs, sidecar.port)
    path, key = unique_path(BEHIND), new_key()
    refused = pay(envoy, path, key)
    assert refused.status_code == 503, refused.content[:200]
    assert b"connection failure" in refused.content or b"connection refused" in refused.content.lower()
    assert rule_counter(envoy, RULE, "released") == 1
    upstream = procs.upstream(port=port)
    done = pay(envoy, path, key)
    assert done.status_code == 201 and not is_replay(done), done.content[:200]
    assert is_replay(pay(envoy, path, key))
    assert upstream.executions(path) == 1


def test_on_gateway_error_release_lets_the_retry_run_by_choice(procs) -> None:
    upstream = procs.upstream()
    sidecar = start_sidecar(procs, upstream.port)
    config = sample_single_proxy_config()
    config["rules"].insert(0, rule(RULE, prefixes=[BEHIND], on_gateway_error="release"))
    envoy = edge_envoy(procs, sidecar.port, config)
    path, key = unique_path(BEHIND), new_key()
    assert pay(envoy, path, key, **{"x-demo-delay-ms": "1500"}).status_code == 504
    done = pay(envoy, path, key)
    assert done.status_code == 201, done.content[:200]
    assert upstream.executions(path) == 2
    assert rule_counter(envoy, RULE, "released") == 1


# --------------------------------------------------------------------------
# gRPC through a sidecar
# --------------------------------------------------------------------------


GRPC_LEASE_SECONDS = 3


def start_grpc_chain(procs: harness.ProcessGroup, **orders: Any
                     ) -> tuple[harness.Envoy, grpc_calls.GrpcServer]:
    """The gRPC chain; ``orders`` changes fields of envoy-grpc.yaml's ``orders`` rule."""
    server = grpc_calls.start_server(procs)
    sidecar = start_sidecar(procs, server.port, cluster="orders_sidecar", http2=True)
    plugin = grpc_calls.plugin_config(lease_seconds=GRPC_LEASE_SECONDS, **orders)
    envoy = grpc_calls.grpc_envoy(procs, server, plugin)
    harness.set_cluster_port(envoy.config, grpc_calls.SERVICE_CLUSTER, sidecar.port)
    envoy.start()
    return envoy, server


@pytest.fixture
def grpc_chain(procs: harness.ProcessGroup) -> Iterator[tuple[harness.Envoy, grpc_calls.GrpcServer]]:
    envoy, server = start_grpc_chain(procs)
    yield envoy, server
    assert not crash_lines(envoy.log_text())


def test_a_sidecars_timeout_on_a_grpc_call_never_runs_it_again(grpc_chain) -> None:
    envoy, server = grpc_chain
    key = new_key()
    md = [("x-test-sleep-ms", "1500")]
    first = grpc_calls.call(envoy, key, metadata=md)
    assert first.code == grpc.StatusCode.UNAVAILABLE, first
    assert "upstream request timeout" in (first.details or ""), first
    for _ in range(2):
        retry = grpc_calls.call(envoy, key, metadata=md)
        assert retry.code == grpc.StatusCode.FAILED_PRECONDITION, retry
    harness.wait_until(lambda: server.executions(key) == 1, timeout=10, what="the call ran")
    time.sleep(GRPC_LEASE_SECONDS + 0.5)  # the call completed behind the sidecar; past the lease
    retry = grpc_calls.call(envoy, key, metadata=md)
    assert retry.code == grpc.StatusCode.FAILED_PRECONDITION, retry
    assert server.executions(key) == 1
    assert rule_counter(envoy, "orders", "outcome_unknown") == 1


def test_a_grpc_clients_retry_policy_on_unavailable_never_runs_it_twice(grpc_chain) -> None:
    """grpcio's own retry policy on UNAVAILABLE, the code a sidecar's timeout reaches it as."""
    envoy, server = grpc_chain
    key = new_key()
    retrying = grpc_calls.channel(envoy, grpc_calls.retry_policy(["UNAVAILABLE"]))
    answer = grpc_calls.call(retrying, key, metadata=[("x-test-sleep-ms", "1500")])
    assert answer.code == grpc.StatusCode.FAILED_PRECONDITION, answer
    harness.wait_until(lambda: server.executions(key) == 1, timeout=10, what="the call ran")
    time.sleep(1.0)
    assert server.executions(key) == 1


def test_the_grpc_services_own_unavailable_releases_and_the_retry_runs(grpc_chain) -> None:
    envoy, server = grpc_chain
    key = new_key()
    md = [("x-test-unavailable-first", "1")]
    first = grpc_calls.call(envoy, key, metadata=md)
    assert first.code == grpc.StatusCode.UNAVAILABLE and "warming up" in (first.details or ""), first
    assert grpc_calls.call(envoy, key, metadata=md).code == grpc.StatusCode.OK
    assert server.executions(key) == 1
    assert rule_counter(envoy, "orders", "released") == 1


@needs_route_cluster
def test_a_sidecars_timeout_on_a_grpc_call_converges_with_resolve_to_the_calls_result(procs) -> None:
    """The rule's ``resolve`` calls the service's Lookup method with the key's metadata once
    the settle time has passed: the retry gets the order the first call placed."""
    envoy, server = start_grpc_chain(procs, resolve={
        "path": "/shop.v1.Orders/Lookup", "settle_seconds": SETTLE_SECONDS, "backoff_seconds": 1})
    key = new_key()
    first = grpc_calls.call(envoy, key, b"gift", metadata=[("x-test-sleep-ms", "1500")])
    assert first.code == grpc.StatusCode.UNAVAILABLE, first
    early = grpc_calls.call(envoy, key, b"gift")
    assert early.code == grpc.StatusCode.FAILED_PRECONDITION, early
    deadline = time.monotonic() + 20
    while (answer := grpc_calls.call(envoy, key, b"gift")).code == grpc.StatusCode.FAILED_PRECONDITION:
        assert time.monotonic() < deadline, "still unknown"
        time.sleep(0.3)
    assert answer.code == grpc.StatusCode.OK, answer
    assert answer.message == b"placed:gift:1", answer
    assert answer.initial.get("idempotent-resolved") == "true", answer.initial
    assert server.executions(key) == 1
    assert server.counts()["lookups"].get(key, 0) >= 1
    assert not crash_lines(envoy.log_text())


def test_the_grpc_services_own_deadline_exceeded_after_the_write_is_unknown(grpc_chain) -> None:
    """The service answers DEADLINE_EXCEEDED itself after it ran the call (its own deadline,
    or one a proxy propagated): someone gave up while it may have run. It used to be recorded
    and replayed; the retry is now told the outcome is unknown, and nothing runs again."""
    envoy, server = grpc_chain
    key = new_key()
    first = grpc_calls.call(envoy, key, metadata=[("x-test-status", "4")])
    assert first.code == grpc.StatusCode.DEADLINE_EXCEEDED, first
    retry = grpc_calls.call(envoy, key)
    assert retry.code == grpc.StatusCode.FAILED_PRECONDITION, retry
    assert server.executions(key) == 1
    assert rule_counter(envoy, "orders", "outcome_unknown") == 1

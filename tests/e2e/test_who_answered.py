"""End-to-end: the rows of the table in docs/guarantees.md "Unknown outcomes" that release a key,
through real Envoy (envoy/envoy.yaml with a route and a cluster for each row). A release is the
dangerous direction: the retry runs. So each test counts the executions at the demo upstream,
brings back what was missing and shows the retry runs exactly once, its own retry replayed.

- no healthy upstream (``UH``): a cluster whose one host fails its TCP health check until the
  upstream starts on its port;
- a circuit breaker at 0 (``UO``), opened at runtime through the admin API;
- no route (``NR``): a route switched off at runtime, switched on through the admin API;
- no cluster (``NC``): a route naming its cluster by a request header;
- a ``direct_response`` route, recorded as the route's own answer (its 503 released);
- a filter after this one that answers (the fault filter aborting on a request header);
- a route that retries when something strips ``x-envoy-max-retries`` after the filter: counted
  ``resent``, and its failure is an unknown outcome.
"""

from __future__ import annotations

import time
from typing import Iterator

import pytest

import client
import harness
from helpers import (
    crash_lines,
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

RULE = "rows"
NR_RUNTIME_KEY = "rows.no_route_yet"
NR_HOST = "nr.rows.test"


def cluster(name: str, port: int, **extra) -> dict:
    return {
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{
            "endpoint": {"address": {"socket_address": {
                "address": harness.LOOPBACK, "port_value": port}}}}]}]},
        **extra,
    }


def hcm(config: dict) -> dict:
    return next(f["typed_config"] for listener in config["static_resources"]["listeners"]
                for chain in listener["filter_chains"] for f in chain["filters"]
                if f["name"] == "envoy.filters.network.http_connection_manager")


def rows_mutate(upstream_port: int, unhealthy_port: int):
    def mutate(config: dict) -> None:
        prepend_routes(config, [
            {"match": {"prefix": "/row-uh/"}, "route": {"cluster": "checked", "timeout": "5s"}},
            {"match": {"prefix": "/row-uo/"}, "route": {"cluster": "narrow", "timeout": "5s"}},
            {"match": {"prefix": "/row-nc/"},
             "route": {"cluster_header": "x-row-cluster", "timeout": "5s"}},
            {"match": {"prefix": "/row-direct-201/"},
             "direct_response": {"status": 201, "body": {"inline_string": "{\"order\":\"fixed\"}"}}},
            {"match": {"prefix": "/row-direct-503/"},
             "direct_response": {"status": 503, "body": {"inline_string": "maintenance"}}},
            {"match": {"prefix": "/row-direct-504/"},
             "direct_response": {"status": 504, "body": {"inline_string": "maintenance"}}},
            {"match": {"prefix": "/row-resent/"},
             "route": {"cluster": "demo_upstream", "timeout": "10s",
                       "retry_policy": {"retry_on": "5xx", "num_retries": 2}}},
        ])
        config["static_resources"]["clusters"] += [
            cluster("checked", unhealthy_port,
                    health_checks=[{"timeout": "0.5s", "interval": "0.3s", "no_traffic_interval": "0.3s",
                                    "unhealthy_threshold": 1, "healthy_threshold": 1,
                                    "tcp_health_check": {}}],
                    # Without it Envoy sends to an unhealthy host when none is healthy.
                    common_lb_config={"healthy_panic_threshold": {"value": 0}}),
            # A circuit breaker at 0, opened at runtime (Envoy reads its thresholds there).
            cluster("narrow", upstream_port,
                    circuit_breakers={"thresholds": [{"max_requests": 0}]}),
        ]
        # A host whose one route is off until switched on at runtime: until then, no route.
        hcm(config)["route_config"]["virtual_hosts"].insert(0, {
            "name": "rows-nr", "domains": [NR_HOST],
            "routes": [{"match": {"prefix": "/row-nr/", "runtime_fraction": {
                "default_value": {"numerator": 0, "denominator": "HUNDRED"},
                "runtime_key": NR_RUNTIME_KEY}},
                "route": {"cluster": "demo_upstream", "timeout": "5s"}}]})
        config["layered_runtime"] = {"layers": [{"name": "admin", "admin_layer": {}}]}
        chain = hcm(config)["http_filters"]
        after = next(i for i, f in enumerate(chain) if f["name"] == "idempotency") + 1
        chain[after:after] = [
            {"name": "envoy.filters.http.fault", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault",
                "abort": {"header_abort": {}, "percentage": {"numerator": 100}}}},
            # Something after the filter that strips the filter's cap on the router's retries.
            {"name": "envoy.filters.http.header_mutation", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
                "mutations": {"request_mutations": [{"remove": "x-envoy-max-retries"}]}}},
        ]
    return mutate


@pytest.fixture
def rows(procs: harness.ProcessGroup) -> Iterator[tuple[harness.Envoy, harness.Upstream, int]]:
    upstream = procs.upstream()
    unhealthy_port = harness.free_port()
    config = sample_single_proxy_config()
    config["rules"].insert(0, rule(RULE, prefixes=["/row-"]))
    envoy = start_envoy(procs, upstream, config, name="envoy-rows",
                        mutate=rows_mutate(upstream.port, unhealthy_port))
    yield envoy, upstream, unhealthy_port
    assert not crash_lines(envoy.log_text())


def runs_once_now(envoy: harness.Envoy, upstream: harness.Upstream, path: str, key: str,
                  **headers: str) -> None:
    """The retry runs, once; its own retry is a replay."""
    done = post(envoy, path, key=key, headers=headers)
    assert done.status_code == 201 and not is_replay(done), (done.status_code, done.content[:200])
    assert is_replay(post(envoy, path, key=key, headers=headers))
    assert upstream.executions(path) == 1


def not_the_filters(resp: client.Response, status: int) -> None:
    assert resp.status_code == status, (resp.status_code, resp.content[:200])
    assert "problem+json" not in resp.headers.get("content-type", ""), dict(resp.headers)


def test_no_healthy_upstream_releases_and_the_retry_runs_once_a_host_is_healthy(procs, rows) -> None:
    envoy, _, port = rows
    path, key = unique_path("row-uh"), new_key()
    refused = post(envoy, path, key=key)
    not_the_filters(refused, 503)
    assert refused.content == b"no healthy upstream", refused.content
    assert rule_counter(envoy, RULE, "released") == 1
    upstream = procs.upstream(port=port, name="checked-upstream")
    harness.wait_until(
        lambda: "checked::" + f"{harness.LOOPBACK}:{port}::health_flags::healthy"
        in envoy.admin("/clusters").text,
        timeout=10, what="the host healthy")
    runs_once_now(envoy, upstream, path, key)


def test_a_circuit_breaker_releases_and_the_retry_runs_once_it_has_room(rows) -> None:
    envoy, upstream, _ = rows
    path, key = unique_path("row-uo"), new_key()
    refused = post(envoy, path, key=key)
    not_the_filters(refused, 503)
    assert b"overflow" in refused.content, refused.content
    assert upstream.executions(path) == 0
    assert rule_counter(envoy, RULE, "released") == 1
    opened = envoy.admin("/runtime_modify?circuit_breakers.narrow.default.max_requests=100",
                         method="POST")
    assert opened.status_code == 200, opened.content
    runs_once_now(envoy, upstream, path, key)


def test_no_route_releases_and_the_retry_runs_once_the_route_is_on(rows) -> None:
    envoy, upstream, _ = rows
    path, key = unique_path("row-nr"), new_key()
    host = {"Host": NR_HOST}
    missing = post(envoy, path, key=key, headers=host)
    not_the_filters(missing, 404)
    assert rule_counter(envoy, RULE, "released") == 1
    assert upstream.executions(path) == 0
    assert envoy.admin(f"/runtime_modify?{NR_RUNTIME_KEY}=100", method="POST").status_code == 200
    runs_once_now(envoy, upstream, path, key, **host)


def test_no_cluster_releases_and_the_retry_to_a_cluster_that_exists_runs_once(rows) -> None:
    envoy, upstream, _ = rows
    path, key = unique_path("row-nc"), new_key()
    missing = post(envoy, path, key=key, headers={"x-row-cluster": "nowhere"})
    not_the_filters(missing, 503)
    assert rule_counter(envoy, RULE, "released") == 1
    assert upstream.executions(path) == 0
    runs_once_now(envoy, upstream, path, key, **{"x-row-cluster": "demo_upstream"})


def test_a_direct_response_is_the_routes_answer_recorded_or_released_by_its_status(rows) -> None:
    envoy, _, _ = rows
    path, key = unique_path("row-direct-201"), new_key()
    first = post(envoy, path, key=key)
    assert first.status_code == 201 and first.content == b'{"order":"fixed"}'
    replay = post(envoy, path, key=key)
    assert is_replay(replay) and replay.content == first.content
    # Nothing left Envoy: a 504 of the route's own is no proxy that gave up.
    released = 0
    for status in (503, 504):
        path, key = unique_path(f"row-direct-{status}"), new_key()
        for _ in (1, 2):
            not_the_filters(post(envoy, path, key=key), status)
            released += 1
            assert rule_counter(envoy, RULE, "released") == released


def test_a_filter_after_this_one_that_answers_releases_and_the_retry_runs_once(rows) -> None:
    envoy, upstream, _ = rows
    path, key = unique_path("row-fault"), new_key()
    aborted = post(envoy, path, key=key, headers={"x-envoy-fault-abort-request": "503"})
    not_the_filters(aborted, 503)
    assert b"fault filter abort" in aborted.content, aborted.content
    assert rule_counter(envoy, RULE, "released") == 1
    assert upstream.executions(path) == 0
    runs_once_now(envoy, upstream, path, key)


def test_a_router_that_resends_after_the_cap_is_stripped_is_counted_and_unknown(rows) -> None:
    envoy, upstream, _ = rows
    path, key = unique_path("row-resent"), new_key()
    failed = post(envoy, path, key=key, headers={"x-demo-status": "500"})
    assert failed.status_code == 500
    assert upstream.executions(path) == 3, "the router sent it three times"
    assert rule_counter(envoy, RULE, "resent") == 1
    problem(post(envoy, path, key=key), 409, "outcome-unknown", rule=RULE)
    assert upstream.executions(path) == 3

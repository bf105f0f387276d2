"""The harness itself, without the wasm filter: upstream, Envoy, redis."""

from __future__ import annotations

import hashlib
import json

import pytest

import client
import harness


def test_free_ports_are_distinct() -> None:
    ports = {harness.free_port() for _ in range(20)}
    assert len(ports) == 20


def test_upstream_counts_executions(upstream: harness.Upstream) -> None:
    body = b'{"item":"book"}'
    first = client.post(upstream.url("/orders/1?a=b"), body=body, timeout=5)
    second = client.post(upstream.url("/orders/1"), body=body, timeout=5)
    assert first.status_code == second.status_code == 201
    assert first.headers["x-execution"] == "1"
    assert second.headers["x-execution"] == "2"
    assert first.headers["set-cookie"] == "demo-session=1; HttpOnly"
    assert first.content != second.content
    doc = first.json()
    assert doc == {
        "execution": 1,
        "method": "POST",
        "path": "/orders/1",
        "query": "a=b",
        "body_bytes": len(body),
        "body_sha256": hashlib.sha256(body).hexdigest(),
    }
    assert upstream.executions("/orders/1") == 2
    assert upstream.executions("/orders/2") == 0
    assert upstream.total() == 2

    delayed = client.post(
        upstream.url("/orders/2"),
        headers={"x-demo-status": "503", "x-demo-body-bytes": "10", "x-demo-delay-ms": "50"},
        timeout=5,
    )
    assert (delayed.status_code, len(delayed.content)) == (503, 10)

    upstream.reset()
    assert upstream.total() == 0
    assert upstream.executions("/orders/1") == 0


def test_upstream_restart_keeps_port(upstream: harness.Upstream) -> None:
    client.post(upstream.url("/x"), timeout=5)
    pid = upstream.process.pid
    upstream.restart()
    assert upstream.process.pid != pid
    assert upstream.executions("/x") == 0
    assert "demo-upstream listening on" in upstream.log_text()


def test_envoy_routes_to_upstream(upstream: harness.Upstream, envoy_factory) -> None:
    envoy = envoy_factory(harness.router_config("demo_upstream"), cluster_ports={"demo_upstream": upstream.port})
    resp = client.post(envoy.url("/orders/7?q=1"), body=b"abc", timeout=10)
    assert resp.status_code == 201
    assert resp.headers["x-execution"] == "1"
    assert resp.json()["path"] == "/orders/7"
    assert upstream.executions("/orders/7") == 1

    stats = envoy.stats()
    assert stats["cluster.demo_upstream.upstream_rq_201"] == 1
    assert envoy.admin("/ready").status_code == 200

    envoy.restart()
    resp = client.post(envoy.url("/orders/7"), timeout=10)
    assert resp.headers["x-execution"] == "2"
    assert envoy.stats().get("cluster.demo_upstream.upstream_rq_201") == 1  # fresh process
    assert "starting main dispatch loop" in envoy.log_text()
    pid = envoy.process.pid
    envoy.stop()
    assert not envoy.alive()
    assert pid is not None


def test_two_envoys_run_side_by_side(upstream: harness.Upstream, envoy_factory) -> None:
    ports = {"demo_upstream": upstream.port}
    a = envoy_factory(harness.router_config(), cluster_ports=ports)
    b = envoy_factory(harness.router_config(), cluster_ports=ports, name="envoy-b")
    assert a.port != b.port and a.admin_port != b.admin_port
    for envoy in (a, b):
        assert client.post(envoy.url("/both"), timeout=10).status_code == 201
    assert upstream.executions("/both") == 2


def test_envoy_validate_and_expected_failure(tmp_path, procs: harness.ProcessGroup) -> None:
    good = harness.Envoy(harness.router_config(), tmp_path, cluster_ports={"demo_upstream": 1}, name="good")
    ok, output = good.validate_config()
    assert ok, output

    def break_it(config: dict) -> None:
        config["static_resources"]["clusters"][0]["type"] = "NOT_A_TYPE"

    bad = harness.Envoy(harness.router_config(), tmp_path, mutate=break_it, name="bad")
    ok, output = bad.validate_config()
    assert not ok
    assert "NOT_A_TYPE" in output

    procs.add(bad)
    code, log = bad.start_expecting_failure(timeout=30)
    assert code != 0
    assert "NOT_A_TYPE" in log


@pytest.mark.skipif(harness.FILTER_BUILD == "native", reason="checks the Wasm configuration the harness writes")
def test_envoy_config_rewrites(tmp_path) -> None:
    config = harness.router_config("demo_upstream")
    http_filters = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "http_filters"
    ]
    http_filters.insert(0, {
        "name": "idempotency",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": "{}"},
                "vm_config": {"runtime": "envoy.wasm.runtime.v8", "code": {"local": {"filename": "x.wasm"}}},
            },
        },
    })
    envoy = harness.Envoy(
        config,
        tmp_path,
        cluster_ports={"demo_upstream": 4242},
        plugin_config={"ttl_seconds": 60},
        wasm_path="target/filter.wasm",
    )
    written = harness.yaml.safe_load(envoy.write_config().read_text())
    plugin = written["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "http_filters"
    ][0]["typed_config"]["config"]
    assert json.loads(plugin["configuration"]["value"]) == {"ttl_seconds": 60}
    assert plugin["vm_config"]["code"]["local"]["filename"].startswith("/")
    assert harness.get_plugin_configuration(written) == {"ttl_seconds": 60}
    endpoint = written["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]
    assert endpoint["endpoint"]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 4242}
    assert written["admin"]["address"]["socket_address"]["port_value"] == envoy.admin_port
    assert config["admin"]["address"]["socket_address"]["port_value"] == 0  # caller's dict untouched

    with pytest.raises(KeyError):
        harness.Envoy(harness.router_config(), tmp_path, cluster_ports={"nope": 1})
    with pytest.raises(KeyError):
        harness.Envoy(harness.router_config(), tmp_path, plugin_config={})


def test_envoy_build_is_per_instance(tmp_path) -> None:
    """An Envoy given a build runs it whatever the suite's (the bench measures both in one
    run): its config, its environment and the names its stats are read under."""
    def wasm_filter(plugin: dict):
        def add(config: dict) -> None:
            chain = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            chain["http_filters"].insert(0, {"name": "idempotency", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                "config": {"configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                                             "value": json.dumps(plugin)},
                           "vm_config": {"runtime": "envoy.wasm.runtime.v8",
                                         "code": {"local": {"filename": "x.wasm"}}}}}})
        return add

    def filter_type(envoy: harness.Envoy) -> str:
        return next(f for f in harness._http_filters(envoy.config) if f["name"] == "idempotency")["typed_config"]["@type"]

    ports = {"demo_upstream": 4242}
    for build, suffix in (("wasm", "wasm.v3.Wasm"), ("native", "dynamic_modules.v3.DynamicModuleFilter")):
        envoy = harness.Envoy(harness.router_config(), tmp_path, cluster_ports=ports,
                              mutate=wasm_filter({"rules": []}), build=build, name=f"envoy-{build}")
        assert envoy.build == build
        assert filter_type(envoy).endswith(suffix)
    native_dir = str(harness.native_module_dir())
    assert harness.envoy_environment("native")["ENVOY_DYNAMIC_MODULES_SEARCH_PATH"] == native_dir
    assert harness.envoy_environment("wasm").get("ENVOY_DYNAMIC_MODULES_SEARCH_PATH") == \
        harness.os.environ.get("ENVOY_DYNAMIC_MODULES_SEARCH_PATH")
    with pytest.raises(ValueError):
        harness.Envoy(harness.router_config(), tmp_path, cluster_ports=ports, build="wasm32")


def test_redis_start_restart_stop(tmp_path, procs: harness.ProcessGroup) -> None:
    redis = procs.redis(appendonly=True)
    assert redis.command("SET", "k", "v") is True  # redis-py's reply to OK
    redis.restart()
    assert redis.command("GET", "k") == b"v"
    volatile = procs.redis(name="redis-volatile")
    volatile.command("SET", "k", "v")
    volatile.restart()
    assert volatile.command("GET", "k") is None
    pid = redis.process.pid
    assert redis.stop() == 0
    assert not redis.ping()
    assert pid is not None


def test_managed_process_escalates_to_sigkill(tmp_path) -> None:
    script = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)\n"
    proc = harness.ManagedProcess(["python3", "-c", script], name="stubborn", log_dir=tmp_path, stop_timeout=0.5)
    with proc:
        harness.wait_until(lambda: "\nup\n" in proc.log_text(), timeout=10, what="child printed")
    assert proc.returncode == -9
    assert not proc.alive()

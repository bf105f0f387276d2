"""Configuration pushes and restarts, through real Envoy: what survives and what does not.

A push is what Istio does all day: the listener (with the filter's plugin configuration) is
replaced while Envoy runs. Here the listener comes from a file Envoy watches (LDS from the
filesystem), and a push is an atomic rename of a new version of that file. Envoy builds the
new listener with a new plugin root context (``on_configure`` runs again in every worker)
while the process's shared data, and so the local table, stays.

A restart is a new process: shared data is per process, so in single-proxy mode the local
table starts empty; in cluster mode the store still holds every record.
"""

from __future__ import annotations

import copy
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

import harness
from cluster import (
    cluster_plugin_config,
    complete_while_store_down,
    post as cluster_post,
    start_cluster,
)
from helpers import (
    crash_lines,
    is_replay,
    new_key,
    plugin_config,
    post,
    rule,
    start_envoy,
    unique_path,
)

LISTENER_TYPE = "type.googleapis.com/envoy.config.listener.v3.Listener"


class PushableEnvoy:
    """envoy/envoy.yaml in single-proxy mode with its listener served from a watched file, so
    the plugin configuration can be pushed while Envoy runs."""

    def __init__(self, procs: harness.ProcessGroup, tmp_path: Path, upstream: harness.Upstream,
                 config: dict, *, name: str = "envoy-pushed", store_port: int | None = None,
                 **envoy_kwargs) -> None:
        self.lds_dir = tmp_path / f"lds-{name}"
        self.lds_dir.mkdir()
        self.lds_path = self.lds_dir / "listeners.yaml"
        self.version = 0
        self.listener: dict = {}
        self.clusters: list = []

        def to_lds(envoy_config: dict) -> dict:
            static = envoy_config["static_resources"]
            (self.listener,) = static.pop("listeners")
            self.clusters = static.get("clusters", [])
            self._write_listener()
            envoy_config["node"] = {"id": name, "cluster": "tests"}
            envoy_config["dynamic_resources"] = {
                "lds_config": {
                    "resource_api_version": "V3",
                    "path_config_source": {
                        "path": str(self.lds_path),
                        "watched_directory": {"path": str(self.lds_dir)},
                    },
                }
            }
            return envoy_config

        self.envoy = start_envoy(procs, upstream, config, store_port=store_port, name=name, mutate=to_lds,
                                 **envoy_kwargs)

    def _write_listener(self) -> None:
        listener = dict(copy.deepcopy(self.listener), **{"@type": LISTENER_TYPE})
        harness.for_this_build({"static_resources": {"listeners": [listener]}}, clusters=self.clusters)
        staged = self.lds_dir / f".listeners.{self.version}.yaml"
        staged.write_text(yaml.safe_dump({"resources": [listener]}, sort_keys=False))
        os.replace(staged, self.lds_path)  # Envoy reloads on the move into the directory

    def remove_filter(self, timeout: float = 20.0) -> None:
        """Takes the idempotency filter out of the listener and waits until Envoy serves it."""
        before = self.envoy.stat("listener_manager.listener_modified")
        self.version += 1
        self.listener = copy.deepcopy(self.listener)
        for chain in self.listener.get("filter_chains", []):
            for net_filter in chain.get("filters", []):
                typed = net_filter.get("typed_config") or {}
                if "http_filters" in typed:
                    typed["http_filters"] = [f for f in typed["http_filters"]
                                             if f.get("name") != harness.IDEMPOTENCY_FILTER_NAME]
        self._write_listener()
        harness.wait_until(
            lambda: self.envoy.stat("listener_manager.listener_modified") > before
            and self.envoy.stat("listener_manager.total_listeners_warming") == 0,
            timeout=timeout, what="Envoy to take the listener without the filter")

    def push(self, config: dict, timeout: float = 20.0) -> None:
        """Replaces the plugin configuration and waits until Envoy serves the new listener."""
        before = self.envoy.stat("listener_manager.listener_modified")
        self.version += 1
        self.listener = copy.deepcopy(self.listener)
        harness.set_plugin_configuration({"static_resources": {"listeners": [self.listener]}}, config)
        self._write_listener()
        harness.wait_until(
            lambda: self.envoy.stat("listener_manager.listener_modified") > before
            and self.envoy.stat("listener_manager.total_listeners_warming") == 0,
            timeout=timeout, what="Envoy to take the pushed listener")


def orders_rule(**fields) -> dict:
    return rule("orders", prefixes=["/orders"], **fields)


def assert_no_crash(envoy: harness.Envoy) -> None:
    assert crash_lines(envoy.log_text()) == []


def test_a_push_keeps_every_record_and_claim(procs, tmp_path) -> None:
    """A push with the same table (here: a longer lease, as a tuning change would be) keeps
    what the table holds: a recorded write replays, one still in flight answers 409, and the
    in-flight one's response is recorded under the new configuration."""
    upstream = procs.upstream()
    pushed = PushableEnvoy(procs, tmp_path, upstream, plugin_config(orders_rule(), capacity=1024))
    envoy = pushed.envoy
    done_path, done_key = unique_path("orders"), new_key()
    first = post(envoy, done_path, key=done_key)
    assert first.status_code == 201 and not is_replay(first)

    slow_path, slow_key = unique_path("orders"), new_key()
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(post, envoy, slow_path,
                           key=slow_key, headers={"x-demo-delay-ms": "3000"})
        harness.wait_until(lambda: upstream.executions(slow_path) == 1, timeout=10,
                           what="the slow write to reach the upstream")
        pushed.push(plugin_config(orders_rule(lease_seconds=120), capacity=1024))
        assert envoy.stat("listener_manager.listener_modified") >= 1

        replay = post(envoy, done_path, key=done_key)
        assert (replay.status_code, is_replay(replay), replay.content) == (201, True, first.content)
        assert post(envoy, slow_path, key=slow_key).status_code == 409
        slow_answer = slow.result(timeout=20)
    assert slow_answer.status_code == 201
    again = post(envoy, slow_path, key=slow_key)
    assert (again.status_code, is_replay(again), again.content) == (201, True, slow_answer.content)
    assert upstream.executions(done_path) == 1 and upstream.executions(slow_path) == 1
    assert_no_crash(envoy)


def test_a_capacity_change_still_replays_and_says_what_it_holds(procs, tmp_path) -> None:
    """A new ``local_table.capacity`` is a new table. The one it replaces stays readable until
    its records expire, so a write recorded before the push still replays (and one still in
    flight still gets 409) instead of executing again; the log says the old table's memory
    is held and until when. Pushing the old capacity back finds its records again."""
    upstream = procs.upstream()
    pushed = PushableEnvoy(procs, tmp_path, upstream, plugin_config(orders_rule(), capacity=1024))
    envoy = pushed.envoy
    path, key = unique_path("orders"), new_key()
    first = post(envoy, path, key=key)
    assert first.status_code == 201 and not is_replay(first)

    pushed.push(plugin_config(orders_rule(), capacity=4096))
    replay = post(envoy, path, key=key)
    assert (replay.status_code, is_replay(replay), replay.content) == (201, True, first.content)
    other = post(envoy, path, key=key, body=b'{"sku":"other"}')
    assert other.status_code == 422
    fresh_path, fresh_key = unique_path("orders"), new_key()
    fresh = post(envoy, fresh_path, key=fresh_key)
    assert fresh.status_code == 201 and not is_replay(fresh)
    earlier = harness.table_geometry(1024).bucket_key.split("/")[-3]  # the layout's tag
    assert f"local_table changed: the earlier table {earlier} is still consulted" in envoy.log_text()

    pushed.push(plugin_config(orders_rule(), capacity=1024))
    for p, k, original in ((path, key, first), (fresh_path, fresh_key, fresh)):
        again = post(envoy, p, key=k)
        assert (again.status_code, is_replay(again), again.content) == (201, True, original.content)
    assert upstream.executions(path) == 1 and upstream.executions(fresh_path) == 1
    assert_no_crash(envoy)


def test_a_restart_starts_the_local_table_empty(procs, tmp_path) -> None:
    """Single-proxy mode keeps records in the Envoy process's shared data: a new process
    (restart, hot restart, a new pod) starts with none, so a retry after it executes again.
    docs/guarantees.md "What can still run twice" says so and points to cluster mode, whose
    store keeps them (see test_cluster.py::test_envoy_restart_replays_from_the_store)."""
    upstream = procs.upstream()
    envoy = start_envoy(procs, upstream, plugin_config(orders_rule()), name="envoy-restarted")
    path, key = unique_path("orders"), new_key()
    first = post(envoy, path, key=key)
    assert first.status_code == 201 and not is_replay(first)
    assert is_replay(post(envoy, path, key=key))
    envoy.restart()
    after = post(envoy, path, key=key)
    assert after.status_code == 201 and not is_replay(after)
    assert upstream.executions(path) == 2


def test_store_writes_waiting_out_an_outage_survive_a_push(procs, tmp_path) -> None:
    """Cluster mode: the store is down while a write completes, so its completion waits in
    the root context that served it. A push then replaces the configuration and the old
    listener drains away (drain time 1 s here). The old root context must not take the
    waiting completion with it: once the store is back, the completion lands, and a retry
    through another Envoy replays instead of executing again."""
    a, _ = completion_outlives_its_configuration(
        procs, tmp_path, "envoy-pushed-cluster",
        lambda pushed: pushed.push(cluster_plugin_config(timeout_ms=2000, lease_seconds=90)))
    log = a.log_text()
    if harness.FILTER_BUILD == "wasm":
        assert "configuration retired with 1 store write(s) still waiting" in log
        harness.wait_until(lambda: "every waiting store write was taken" in a.log_text(),
                           timeout=10, what="the retired configuration to let go")
    else:
        # Envoy frees a retired dynamic module configuration at once: its courier stays with
        # the module's store thread, which landed the completion its root left.
        assert "store Complete of an idle worker landed by the store thread" in log
    assert_no_crash(a)


@pytest.mark.xfail(harness.FILTER_BUILD == "wasm", strict=True,
                   reason="Envoy destroys a Wasm VM with its last filter configuration, the retired "
                          "root and its waiting completion with it (docs/cluster-mode.md)")
def test_a_completion_waiting_on_a_stopped_store_lands_after_lds_removes_the_filter(
        procs, tmp_path) -> None:
    """Cluster mode: the store is stopped while a write completes, so its completion waits.
    File-based LDS then takes the filter out of the listener, and the old listener drains
    away with the configuration that served the write. What that configuration was asked to
    send must still reach the store once it is back: a retry through another Envoy replays
    the recorded response, and the write ran once."""
    a, _ = completion_outlives_its_configuration(procs, tmp_path, "envoy-filter-removed",
                                                 PushableEnvoy.remove_filter)
    assert_no_crash(a)


def completion_outlives_its_configuration(procs, tmp_path: Path, name: str, reconfigure) -> tuple:
    """Cluster mode, on Envoy A (listener from a watched file) and B: a write through A
    completes while the store is stopped, so its completion waits; ``reconfigure(pushed)``
    then changes A's listener, and the old one drains away (drain time 1 s) with the
    configuration that served the write. Once the store is back the completion must land:
    a retry through B replays the recorded response, and the write ran once. Returns A and
    the retry."""
    base = cluster_plugin_config(timeout_ms=2000, lease_seconds=60)
    cluster = start_cluster(procs, plugin=base, envoys=1)
    pushed = PushableEnvoy(procs, tmp_path, cluster.upstream, base, name=name,
                           store_port=cluster.store.port, extra_args=["--drain-time-s", "1"])
    a = pushed.envoy
    path, key = unique_path(), new_key()
    body = complete_while_store_down(a, cluster, path, key)

    reconfigure(pushed)
    harness.wait_until(
        lambda: a.stat("listener_manager.total_listeners_draining") == 0,
        timeout=20, what="the old listener to drain away")
    time.sleep(2)  # the old configuration is torn down once its listener is gone

    cluster.store.start()
    harness.wait_until(lambda: cluster.store_completions() >= 1, timeout=15,
                       what="the waiting completion to reach the store")
    retry = cluster_post(cluster.a, path, key)
    assert (retry.status_code, is_replay(retry)) == (201, True), retry.content[:200]
    assert retry.content == body
    assert cluster.upstream.executions(path) == 1
    return a, retry

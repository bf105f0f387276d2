"""Envoy's main thread stalled, as xDS, the admin API or a stats flush can stall it: the
filter's store traffic does not wait for it (docs/how-it-works.md, "The native build: who runs
where"). Only the main thread stops (``harness.stalled_main_thread``); the workers run on.

On both builds: the Wasm build's store streams are its workers' own; the native build's are
its store thread's.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from cluster import cluster_plugin_config, post, start_cluster
import harness
from helpers import is_replay, new_key, unique_path

LEASE_SECONDS = 3
STORE_TIMEOUT_MS = 1000


def test_a_stalled_main_thread_neither_delays_claims_nor_lets_a_lease_lapse(procs) -> None:
    """Two Envoys on one store, a 3 s lease, a 10 s write through A. A's main thread stops
    for 6 s. Meanwhile a new write through A is claimed within the store's 1 s timeout (no
    503), and a retry through B 4.5 s into the stall, past the lease had nobody renewed it,
    gets 409: the write runs once, and its retry afterwards is its replay."""
    plugin = cluster_plugin_config(timeout_ms=STORE_TIMEOUT_MS, lease_seconds=LEASE_SECONDS)
    cluster = start_cluster(procs, plugin=plugin, envoys=2)
    a, b = cluster.a, cluster.b
    path, key = unique_path("/orders/stalled-main"), new_key()
    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(post, a, path, key, headers={"x-demo-delay-ms": "10000"}, timeout=30)
        harness.wait_until(lambda: cluster.upstream.executions(path) == 1, timeout=10,
                           what="the first write to reach the upstream")
        assert a.process.pid is not None
        with harness.stalled_main_thread(a.process.pid):
            stalled_at = time.monotonic()
            fresh_path = unique_path("/orders/stalled-main-fresh")
            fresh = post(a, fresh_path, new_key(), timeout=10)
            took = time.monotonic() - stalled_at
            assert fresh.status_code == 201, (fresh.status_code, fresh.content[:300])
            assert took < STORE_TIMEOUT_MS / 1000, f"the claim waited {took:.2f} s"
            time.sleep(max(0.0, stalled_at + 4.5 - time.monotonic()))
            retry = post(b, path, key, timeout=10)
            assert retry.status_code == 409, (retry.status_code, retry.content[:300])
            time.sleep(max(0.0, stalled_at + 6.0 - time.monotonic()))
        assert first.result().status_code == 201
    harness.wait_until(lambda: post(b, path, key).status_code != 409, timeout=10,
                       what="the completion to reach the store")
    replay = post(b, path, key)
    assert (replay.status_code, is_replay(replay)) == (201, True), replay.content[:300]
    assert cluster.upstream.executions(path) == 1

"""Two retention tiers through real Envoy: a completed record is replayed whole for
``ttl_seconds``, then, for ``tombstone_seconds``, as its tombstone (the recorded status and
headers, ``Idempotent-Body-Omitted: true``, no body), and a retry never executes in either
tier; a reused key with another payload gets 422 in both. Single-proxy mode (the local table)
and cluster mode on each store backend (the store answers an Envoy that never saw the write).
"""

from __future__ import annotations

import time
from email.utils import parsedate_to_datetime

import pytest

import client
from cluster import cluster_plugin_config, post, start_cluster, wait_for_answer
from helpers import (
    is_replay,
    new_key,
    rule_counter,
    sample_single_proxy_config,
    send,
    start_envoy,
    unique_path,
)

TTL_S = 2
TOMBSTONE_S = 600
TIERS = {"ttl_seconds": TTL_S, "lease_seconds": 1, "tombstone_seconds": TOMBSTONE_S}
OTHER_PAYLOAD = b'{"item":"book","qty":2}'


def single_proxy_config() -> dict:
    config = sample_single_proxy_config()
    for rule in config["rules"]:
        if rule["name"] == "orders":
            rule.update(TIERS)
    return config


def assert_whole_replay(replay: client.Response, original: client.Response) -> None:
    assert (replay.status_code, is_replay(replay)) == (original.status_code, True)
    assert replay.content == original.content
    assert "idempotent-body-omitted" not in replay.headers


def assert_tombstone(replay: client.Response, original: client.Response) -> None:
    """The recorded status and headers, the body omitted and said so."""
    assert (replay.status_code, is_replay(replay)) == (original.status_code, True), replay.content
    assert replay.headers.get("idempotent-body-omitted") == "true"
    assert replay.content == b""
    for name in ("content-type", "x-execution", "idempotency-key-expires"):
        assert replay.headers.get(name) == original.headers.get(name), name


def test_single_proxy_replays_whole_then_its_tombstone(procs) -> None:
    upstream = procs.upstream()
    envoy = start_envoy(procs, upstream, single_proxy_config(), name="envoy-tombstones")
    path, key = unique_path(), new_key()
    original = send(envoy, path, key=key)
    assert (original.status_code, is_replay(original)) == (201, False)
    # The key is remembered through the tombstone, and the first answer says so.
    expires = parsedate_to_datetime(original.headers["idempotency-key-expires"]).timestamp()
    assert expires - time.time() > TOMBSTONE_S - 30

    assert_whole_replay(send(envoy, path, key=key), original)
    time.sleep(TTL_S + 0.5)
    assert_tombstone(send(envoy, path, key=key), original)
    assert send(envoy, path, key=key, body=OTHER_PAYLOAD).status_code == 422
    assert upstream.executions(path) == 1
    assert rule_counter(envoy, "orders", "replayed_tombstone") == 1
    assert rule_counter(envoy, "orders", "executed") == 1


@pytest.mark.parametrize("backend", ["embedded", "redis"])
def test_cluster_replays_whole_then_its_tombstone_from_the_store(procs, backend) -> None:
    """Envoy a executes and records; Envoy b, which never saw the write, gets the whole
    response from the store within the TTL and its tombstone after it; Envoy a answers the
    tombstone from its own table."""
    cluster = start_cluster(procs, backend, plugin=cluster_plugin_config(timeout_ms=2000, **TIERS),
                            envoys=3)
    a, b, c = cluster.envoys
    path, key = unique_path(), new_key()
    original = post(a, path, key)
    assert (original.status_code, is_replay(original)) == (201, False)
    whole, _ = wait_for_answer(lambda: post(b, path, key), timeout=10)
    assert_whole_replay(whole, original)

    time.sleep(TTL_S + 0.5)
    # c has never seen the key: the store answers the tombstone.
    assert_tombstone(post(c, path, key), original)
    assert_tombstone(post(a, path, key), original)
    assert post(c, path, key, body=OTHER_PAYLOAD).status_code == 422
    assert cluster.upstream.executions(path) == 1
    assert rule_counter(a, "orders", "replayed_tombstone") == 1

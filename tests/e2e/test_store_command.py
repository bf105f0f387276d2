"""The store's ``record`` command (docs/operations.md "Looking up and purging a record") on
two real Envoys sharing one store: a write found from its access-log hash and from the request
itself, a claim left stuck in flight by an Envoy that crashed, shown with its lease and purged
so that a retry through the other Envoy executes, and the limit of a purge of a completed
record (an Envoy's local copy still replays it)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

import harness
from cluster import HOST, post, raw_post, start_cluster, wait_for_answer
from helpers import REPLAYED, envoy_yaml_plugin_config, line_for, new_key, unique_path

AUTH = "Bearer ops-test-caller"


def record(store: harness.Store, *args: str, token: str | None = None) -> subprocess.CompletedProcess:
    """``idempotency-store record <args>`` against ``store``, with its operator token from the
    environment variable the store itself reads (or ``token`` instead)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RUST_BACKTRACE", "IDEMPOTENCY_STORE_TOKEN")}
    env["IDEMPOTENCY_STORE_OPERATOR_TOKEN"] = token if token is not None else store.operator_token
    done = subprocess.run(
        [str(harness.store_binary()), "record", *args, "--store-url", store.base_url],
        env=env, capture_output=True, text=True, timeout=30,
    )
    assert "panicked" not in done.stderr, done.stderr
    return done


def shown(store: harness.Store, *args: str) -> list[dict]:
    """The records ``record show --json`` finds (asserting it found some)."""
    done = record(store, "show", *args, "--json")
    assert done.returncode == 0, (done.returncode, done.stderr)
    return json.loads(done.stdout)["records"]


def by_request(config: Path, key: str, auth: str = AUTH) -> list[str]:
    """Names a record as the request had it: rule, scope headers, key."""
    return ["--plugin-config", str(config), "--rule", "orders",
            "-H", f"Host: {HOST}", "-H", f"authorization: {auth}", "--key", key]


def client_gives_up(cluster, path: str, key: str) -> None:
    """A 1.5 s write through A whose client leaves after 0.5 s: an unknown outcome."""
    try:
        post(cluster.a, path, key, headers={"authorization": AUTH, "x-demo-delay-ms": "1500"},
             timeout=0.5)
    except Exception:  # noqa: BLE001 - the client gives up, as the test means it to
        pass
    harness.wait_until(lambda: cluster.upstream.executions(path) == 1, timeout=10,
                       what="the write reached the upstream")


def test_record_show_and_purge_through_two_envoys(procs, tmp_path: Path) -> None:
    cluster = start_cluster(procs)
    config = tmp_path / "plugin.json"
    config.write_text(json.dumps(envoy_yaml_plugin_config()))
    run = new_key().replace("-", "")[:12]

    # A write executed through Envoy A; the access log names its record.
    path, key = unique_path("orders"), new_key()
    resp = post(cluster.a, path, key, headers={"authorization": AUTH, "x-request-id": f"write-{run}"})
    assert resp.status_code == 201
    key_hash = line_for(cluster.a, f"write-{run}")["idempotency_key_hash"]
    # The completion reaches the store from Envoy's root context after the response: until
    # then the record shows the claim in flight.
    harness.wait_until(lambda: shown(cluster.store, "--hash", key_hash)[0]["state"] == "completed",
                       timeout=10, what="the completion to reach the store")
    (done,) = shown(cluster.store, "--hash", key_hash)
    assert done["key"].startswith(key_hash) and len(done["key"]) == 64
    assert done["state"] == "completed"
    assert done["response"]["status"] == 201 and not done["response"]["body_omitted"]
    assert done["age_ms"] is not None and done["age_ms"] < 60_000, done
    assert 0 < done["expires_in_ms"] <= 86_400_000
    # The same record from the request itself, as the filter hashed it.
    (same,) = shown(cluster.store, *by_request(config, f'"{key}"'))
    assert same["key"] == done["key"]
    text = record(cluster.store, "show", "--hash", key_hash).stdout
    assert "state        completed" in text and "status       201" in text, text

    # Another caller with the same key is another record; a wrong token is refused.
    missing = record(cluster.store, "show", *by_request(config, key, "Bearer someone-else"))
    assert missing.returncode == 1 and "no live record" in missing.stderr, missing.stderr
    refused = record(cluster.store, "show", "--hash", key_hash, token="wrong-token")
    assert refused.returncode == 2 and "refused the token" in refused.stderr, refused.stderr
    # The token every Envoy holds in its plugin configuration is not an operator's.
    refused = record(cluster.store, "purge", "--hash", key_hash, token=cluster.store.token)
    assert refused.returncode == 2 and "(403)" in refused.stderr, refused.stderr
    assert "data-plane token" in refused.stderr, refused.stderr
    assert shown(cluster.store, "--hash", key_hash), "nothing was purged"

    # Envoy A crashes while its upstream runs the write: the store keeps the claim in
    # flight until its lease ends (60 s), so a retry through B gets 409.
    stuck_path, stuck_key = unique_path("orders"), new_key()
    with raw_post(cluster.a, stuck_path, stuck_key,
                  headers={"authorization": AUTH, "x-demo-delay-ms": "30000"}) as raw:
        harness.wait_until(lambda: cluster.upstream.executions(stuck_path) == 1, timeout=10,
                           what="the upstream to start the write")
        cluster.a.process.kill()
        raw.abort()

    def retry_through_b():
        return post(cluster.b, stuck_path, stuck_key, headers={"authorization": AUTH})

    assert retry_through_b().status_code == 409
    (stuck,) = shown(cluster.store, *by_request(config, stuck_key))
    assert stuck["state"] == "in_flight" and len(stuck["owner_hash"]) == 16, stuck
    assert "owner" not in stuck, "the owner token would let an operator complete the claim"
    assert 30_000 < stuck["expires_in_ms"] <= 60_000, "the lease has most of a minute left"
    purged = record(cluster.store, "purge", "--hash", stuck["key"][:16])
    assert purged.returncode == 0, purged.stderr
    assert purged.stdout.startswith("purged:") and stuck["key"] in purged.stdout, purged.stdout
    # B dropped its local claim when the store answered in flight: the retry now executes.
    resp = retry_through_b()
    assert resp.status_code == 201 and REPLAYED not in resp.headers, resp.status_code
    assert cluster.upstream.executions(stuck_path) == 2

    # Purging a completed record: B (which never saw the key) executes a retry again, but A's
    # local copy still replays it (here A was restarted, so its table is empty: use B's
    # fresh copy of the record just written and another Envoy that has none).
    cluster.a.start()
    harness.wait_until(lambda: shown(cluster.store, "--hash", stuck["key"])[0]["state"] == "completed",
                       timeout=10, what="B's completion to reach the store")
    assert record(cluster.store, "purge", "--hash", stuck["key"]).returncode == 0
    resp = retry_through_b()
    assert resp.status_code == 201 and resp.headers.get(REPLAYED) == "true", "B's local copy"
    assert cluster.upstream.executions(stuck_path) == 2
    resp = post(cluster.a, stuck_path, stuck_key, headers={"authorization": AUTH})
    assert resp.status_code == 201 and REPLAYED not in resp.headers, "A asks the store: gone"
    assert cluster.upstream.executions(stuck_path) == 3

    assert cluster.store.metric("idempotency_store_operations_total", operation="purge",
                                outcome="purged") == 2
    gone = record(cluster.store, "purge", "--hash", "0123456789abcdef")
    assert gone.returncode == 1 and "nothing purged" in gone.stderr


def test_record_resolve_settles_an_unknown_outcome_for_every_envoy(procs, tmp_path: Path) -> None:
    """Without ``resolve`` an unknown outcome is 409 until its TTL; an operator who learned
    what happened (from the service, the bank) settles it: took effect, and every retry through
    either Envoy, the one that recorded it included, replays the response the operator gave;
    never ran, and the next retry executes. A record that is not an unknown outcome is left
    alone."""
    cluster = start_cluster(procs)
    config = tmp_path / "plugin.json"
    config.write_text(json.dumps(envoy_yaml_plugin_config()))

    def unknown_outcome() -> tuple[str, str]:
        path, key = unique_path("orders"), new_key()
        client_gives_up(cluster, path, key)
        time.sleep(1.5)  # it completed upstream; nobody heard
        for envoy in (cluster.a, cluster.b):
            retry = post(envoy, path, key, headers={"authorization": AUTH})
            assert retry.status_code == 409 and "outcome-unknown" in retry.text, retry.text
        return path, key

    path, key = unknown_outcome()
    text = record(cluster.store, "show", *by_request(config, key)).stdout
    assert "outcome      unknown" in text and "resolution   none: settle it by hand" in text, text
    done = record(cluster.store, "resolve", *by_request(config, key), "--took-effect", "--status", "201",
                  "--response-header", "content-type: application/json",
                  "--response-body", '{"order":"o-1"}')
    assert done.returncode == 0, done.stderr
    assert "settled: the write took effect" in done.stdout, done.stdout
    assert "resolved     an unknown outcome, settled as taken effect" in done.stdout, done.stdout
    for envoy in (cluster.a, cluster.b, cluster.a):
        replay = post(envoy, path, key, headers={"authorization": AUTH})
        assert replay.status_code == 201 and replay.text == '{"order":"o-1"}', replay.text
        assert replay.headers[REPLAYED] == "true" and replay.headers["idempotent-resolved"] == "true"
    assert cluster.upstream.executions(path) == 1
    assert "settled an unknown outcome" in cluster.store.log_text()
    assert 'by="operator"' in cluster.store.log_text() or "by=operator" in cluster.store.log_text()

    # Never ran: the Envoy that recorded it runs the retry, once.
    path, key = unknown_outcome()
    done = record(cluster.store, "resolve", *by_request(config, key), "--never-ran")
    assert done.returncode == 0 and "never ran" in done.stdout, done.stderr
    again = post(cluster.a, path, key, headers={"authorization": AUTH})
    assert again.status_code == 201 and again.headers["x-execution"] == "2", again.text
    # Envoy A's record of it reaches the store from its root a moment later.
    through_b, _ = wait_for_answer(lambda: post(cluster.b, path, key, headers={"authorization": AUTH}),
                                   timeout=5)
    assert through_b.headers[REPLAYED] == "true"

    # A completed write is not an unknown outcome: nothing changes.
    refused = record(cluster.store, "resolve", *by_request(config, key), "--never-ran")
    assert refused.returncode == 2 and "not one" in refused.stderr, refused.stderr
    assert post(cluster.a, path, key, headers={"authorization": AUTH}).headers[REPLAYED] == "true"


def test_record_resolve_keeps_the_rules_record_and_tombstone(procs, tmp_path: Path) -> None:
    """An operator's "took effect" keeps what the filter's own resolution would: the rule's
    TTL from the settle, then its tombstone. The unknown outcome carries both (the command
    knows no rule's settings); before, the settled record ended with the unknown outcome's TTL,
    without a tombstone, and a late redelivery ran the write again."""
    ttl = 6
    plugin = envoy_yaml_plugin_config()
    orders = next(r for r in plugin["rules"] if r["name"] == "orders")
    orders.update(ttl_seconds=ttl, lease_seconds=ttl, tombstone_seconds=300)
    cluster = start_cluster(procs, plugin=plugin)
    config = tmp_path / "plugin.json"
    config.write_text(json.dumps(plugin))
    path, key = unique_path("orders"), new_key()
    started = time.monotonic()
    client_gives_up(cluster, path, key)
    harness.wait_until(
        lambda: "outcome-unknown" in post(cluster.b, path, key, headers={"authorization": AUTH}).text,
        timeout=10, what="the unknown outcome in the store")
    # Settled halfway through the unknown outcome's TTL: what it keeps is told apart from it.
    time.sleep(max(0.0, started + ttl / 2 - time.monotonic()))
    done = record(cluster.store, "resolve", *by_request(config, key), "--took-effect", "--status", "201",
                  "--response-header", "content-type: application/json",
                  "--response-body", '{"order":"o-1"}')
    assert done.returncode == 0, done.stderr
    settled = time.monotonic()
    # Past the unknown outcome's own TTL, then past the settled record's.
    time.sleep(max(0.0, started + ttl + 0.5 - time.monotonic()))
    replay = post(cluster.a, path, key, headers={"authorization": AUTH})
    assert replay.status_code == 201 and replay.text == '{"order":"o-1"}', replay.text
    time.sleep(max(0.0, settled + ttl + 1 - time.monotonic()))
    # Through B, which keeps no copy of it: the store's tombstone.
    late = post(cluster.b, path, key, headers={"authorization": AUTH})
    assert late.status_code == 201 and late.headers.get(REPLAYED) == "true", late.text
    assert late.headers.get("idempotent-body-omitted") == "true" and late.content == b"", late.text
    assert cluster.upstream.executions(path) == 1

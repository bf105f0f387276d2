"""Every decision in Envoy's own access log: envoy/envoy.yaml as shipped logs one JSON line per
request with the rule, the outcomes and the short hash of the stored key, read here from two
real Envoys sharing one store. Nothing secret reaches the log."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import harness
from cluster import HOST, post, start_cluster
from helpers import line_for, new_key, send, unique_path

SECRET_TOKEN = "Bearer caller-secret-7f3a"


def test_the_access_log_shows_rule_outcome_and_key_hash_for_each_decision(procs) -> None:
    cluster = start_cluster(procs)
    path, key = unique_path("orders"), new_key()
    # Request ids tell the log lines apart; they share nothing with the key.
    run = new_key().replace("-", "")[:12]
    auth = {"authorization": SECRET_TOKEN}

    def request(envoy: harness.Envoy, name: str, **kwargs) -> tuple[int, dict]:
        headers = {"x-request-id": f"{name}-{run}", **auth, **kwargs.pop("headers", {})}
        resp = post(envoy, kwargs.pop("path", path), kwargs.pop("key", key), headers=headers, **kwargs)
        return resp.status_code, line_for(envoy, f"{name}-{run}")

    with ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(request, cluster.a, "first", headers={"x-demo-delay-ms": "1500"})
        harness.wait_until(lambda: cluster.upstream.executions(path) == 1, timeout=10, what="first upstream")
        status, conflict = request(cluster.b, "conflict")
        assert status == 409
        status, executed = first.result(timeout=20)
    assert status == 201
    status, replay = request(cluster.b, "replay")
    assert status == 201
    status, mismatch = request(cluster.a, "mismatch", body=b'{"sku":"pen","qty":9}')
    assert status == 422

    assert executed["idempotency_rule"] == "orders"
    assert executed["idempotency_outcome"] == "executed"
    assert conflict["idempotency_outcome"] == "conflict"
    assert replay["idempotency_outcome"] == "replayed"
    assert mismatch["idempotency_outcome"] == "mismatch"
    hashes = {e["idempotency_key_hash"] for e in (executed, conflict, replay, mismatch)}
    assert len(hashes) == 1, "every attempt with the key names the same record"
    (key_hash,) = hashes
    assert len(key_hash) == 16 and all(c in "0123456789abcdef" for c in key_hash)
    assert (replay["status"], conflict["status"], mismatch["status"]) == (201, 409, 422)

    # The same key from another caller is another record; a released write says so.
    other = f"other-{run}"
    resp = post(cluster.a, path, key, headers={"x-request-id": other, "authorization": "Bearer someone-else"})
    assert resp.status_code == 201
    assert line_for(cluster.a, other)["idempotency_key_hash"] != key_hash
    released_key = new_key()
    resp = post(cluster.a, unique_path("orders"), released_key,
                headers={"x-request-id": f"released-{run}", "x-demo-status": "503", **auth})
    assert resp.status_code == 503
    assert line_for(cluster.a, f"released-{run}")["idempotency_outcome"] == "executed+released"

    # A refused request names its rule and why; an unprotected one has no idempotency fields.
    resp = send(cluster.a, unique_path("orders"), headers={"Host": HOST, "x-request-id": f"nokey-{run}"})
    assert resp.status_code == 400
    refused = line_for(cluster.a, f"nokey-{run}")
    assert (refused["idempotency_rule"], refused["idempotency_outcome"]) == ("orders", "missing_key")
    assert refused["idempotency_key_hash"] is None
    resp = send(cluster.a, "/healthz-free/x", method="GET", body=None,
                headers={"Host": HOST, "x-request-id": f"plain-{run}"})
    plain = line_for(cluster.a, f"plain-{run}")
    assert (plain["idempotency_rule"], plain["idempotency_outcome"]) == (None, None)

    # Nothing secret: neither the raw key nor the caller's credentials appear.
    for envoy in cluster.envoys:
        text = envoy.log_text()
        assert key not in text, "the raw key is logged"
        assert "caller-secret" not in text, "a credential is logged"

"""End-to-end, single-proxy mode: one Envoy (started from envoy/envoy.yaml) with the
idempotency filter in front of the counting demo upstream, no store. Each test asserts what a
client sees, and counts executions at the upstream.

Two Envoys serve most tests for the whole module: ``sample_envoy`` runs envoy/envoy.yaml with
its own plugin configuration minus the ``store`` section (what the file says to do for
single-proxy mode; only ports and the module path change otherwise); ``tuned_envoy`` runs the
same file with one rule per customisation, each on its own path prefix. Tests whose
configuration is global (table capacity, metrics from zero, refused configurations) start
their own. Every test uses fresh paths and keys, so tests never see each other's records.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

import client
import harness
from helpers import (
    BODY_OMITTED,
    REPLAYED,
    crash_lines,
    envoy_options,
    is_replay,
    new_key,
    plugin_config,
    post,
    problem,
    rule,
    rule_counters,
    sample_single_proxy_config,
    send,
    start_envoy,
    unique_path,
)

# --------------------------------------------------------------------------
# processes shared by the module, and the crash check on every Envoy log
# --------------------------------------------------------------------------

# Every process whose log the crash check reads, with how far it has been read.
_WATCHED: dict[Path, tuple[harness.ManagedProcess, int]] = {}
_MODULE_PROCESSES: list[harness.ManagedProcess] = []


def _watch(proc: harness.ManagedProcess) -> None:
    _WATCHED.setdefault(proc.log_path, (proc, 0))


def _new_crash_lines() -> list[str]:
    found = []
    for path, (proc, offset) in list(_WATCHED.items()):
        text = proc.log_text()
        found += [f"{proc.name}: {line}" for line in crash_lines(text[offset:])]
        _WATCHED[path] = (proc, len(text))
    return found


@pytest.fixture(scope="module")
def module_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.ProcessGroup]:
    group = harness.ProcessGroup(tmp_path_factory.mktemp("single-proxy"))
    try:
        yield group
    finally:
        group.close()


@pytest.fixture(scope="module")
def shared_upstream(module_group: harness.ProcessGroup) -> harness.Upstream:
    up = module_group.upstream()
    _MODULE_PROCESSES.append(up.process)
    return up


def _module_envoy(group: harness.ProcessGroup, upstream: harness.Upstream, name: str, config) -> harness.Envoy:
    envoy = start_envoy(group, upstream, config, name=name)
    assert envoy.process is not None
    _MODULE_PROCESSES.append(envoy.process)
    _watch(envoy.process)
    return envoy


@pytest.fixture(scope="module")
def sample_envoy(module_group: harness.ProcessGroup, shared_upstream: harness.Upstream) -> harness.Envoy:
    """envoy/envoy.yaml with its own plugin configuration (rules `payments` and `orders`),
    single-proxy: without its `store` section."""
    return _module_envoy(module_group, shared_upstream, "envoy-sample", sample_single_proxy_config())


TUNED_CONFIG = plugin_config(
    rule("puts", match={"path_prefixes": ["/puts"], "methods": ["PUT"]}),
    rule("optional", prefixes=["/optional"], key={"required": False}),
    rule("custom-key", prefixes=["/custom-key"], key={"header": "X-Request-Key"}),
    rule("tenant", prefixes=["/tenant"], scope_headers=["x-tenant"]),
    rule("only5xx", prefixes=["/only5xx"], release_on_status=["5xx"]),
    rule("small", prefixes=["/small"], max_response_bytes=1024),
    rule("short-ttl", prefixes=["/short-ttl"], ttl_seconds=2, lease_seconds=1),
    rule("takeover", prefixes=["/takeover"], lease_seconds=1),
    rule(
        "renamed",
        prefixes=["/renamed"],
        replay_header="X-Replayed",
        body_omitted_header="X-Body-Omitted",
        replay_skip_headers=["x-execution"],
        max_response_bytes=64,
    ),
)


@pytest.fixture(scope="module")
def tuned_envoy(module_group: harness.ProcessGroup, shared_upstream: harness.Upstream) -> harness.Envoy:
    """envoy/envoy.yaml with TUNED_CONFIG as its plugin configuration."""
    return _module_envoy(module_group, shared_upstream, "envoy-tuned", TUNED_CONFIG)


@pytest.fixture(autouse=True)
def no_crash_in_logs(request: pytest.FixtureRequest, procs: harness.ProcessGroup) -> Iterator[None]:
    """After each test: no log of any process it used shows a panic or a wasm trap."""
    yield
    for proc in procs.processes():
        _watch(proc)
    if any(getattr(getattr(request.node, f"rep_{w}", None), "failed", False) for w in ("setup", "call")):
        for proc in _MODULE_PROCESSES:
            print(f"\n----- {proc.name} (pid {proc.pid}) log tail: {proc.log_path}")
            lines = [line for line in proc.log_text().splitlines() if "server.cc:4" not in line and "server.cc:5" not in line]
            print("\n".join(lines[-60:]))
    crashes = _new_crash_lines()
    assert not crashes, "crash lines in logs:\n" + "\n".join(crashes)


@pytest.fixture
def envoy_with(procs: harness.ProcessGroup, upstream: harness.Upstream):
    """Starts envoy/envoy.yaml with the given plugin configuration for this test only."""

    def start(config, name: str = "envoy") -> harness.Envoy:
        return start_envoy(procs, upstream, config, name=name)

    return start


# --------------------------------------------------------------------------
# 1. execute once, replay the recorded response
# --------------------------------------------------------------------------


def test_retry_replays_the_recorded_response_and_executes_once(sample_envoy, shared_upstream) -> None:
    path, key = unique_path("orders"), new_key()
    first = post(sample_envoy, path, key=key)
    assert first.status_code == 201, first.text
    assert first.headers["x-execution"] == "1"
    assert REPLAYED not in first.headers
    # What the replay must leave out is really there on the original.
    assert first.headers["set-cookie"] == "demo-session=1; HttpOnly"
    assert "x-envoy-upstream-service-time" in first.headers

    for _ in range(2):
        retry = post(sample_envoy, path, key=key)
        assert retry.status_code == 201
        assert retry.content == first.content
        assert retry.headers[REPLAYED] == "true"
        for name in ("content-type", "x-execution", "cache-control", "x-demo-upstream"):
            assert retry.headers.get(name) == first.headers[name], name
        assert int(retry.headers["content-length"]) == len(first.content)
        assert "set-cookie" not in retry.headers
        assert "x-envoy-upstream-service-time" not in retry.headers
    assert shared_upstream.executions(path) == 1


def test_an_upstream_copy_of_the_replay_header_never_reaches_the_client(sample_envoy, shared_upstream) -> None:
    path, key = unique_path("orders"), new_key()
    headers = {"x-demo-header": "idempotent-replayed=true"}
    first = post(sample_envoy, path, key=key, headers=headers)
    assert first.status_code == 201
    assert REPLAYED not in first.headers
    retry = post(sample_envoy, path, key=key, headers=headers)
    assert retry.headers[REPLAYED] == "true"
    assert retry.content == first.content
    assert shared_upstream.executions(path) == 1


# --------------------------------------------------------------------------
# 2. methods
# --------------------------------------------------------------------------


def test_patch_is_protected_and_other_methods_pass_untouched(sample_envoy, tuned_envoy, shared_upstream) -> None:
    path, key = unique_path("orders"), new_key()
    first = send(sample_envoy, path, method="PATCH", key=key)
    retry = send(sample_envoy, path, method="PATCH", key=key)
    assert first.status_code == retry.status_code == 201
    assert is_replay(retry) and retry.content == first.content
    assert shared_upstream.executions(path) == 1

    for method, body in (("GET", None), ("PUT", b'{"a":1}'), ("DELETE", None)):
        path, key = unique_path("orders"), new_key()
        answers = [send(sample_envoy, path, method=method, key=key, body=body) for _ in range(2)]
        assert [a.status_code for a in answers] == [201, 201], method
        assert [a.headers["x-execution"] for a in answers] == ["1", "2"], method
        assert not any(REPLAYED in a.headers for a in answers), method
        assert shared_upstream.executions(path) == 2, method

    # match.methods ["PUT"]: PUT is protected, POST on the same prefix is not.
    path, key = unique_path("puts"), new_key()
    first = send(tuned_envoy, path, method="PUT", key=key)
    retry = send(tuned_envoy, path, method="PUT", key=key)
    assert first.status_code == 201 and is_replay(retry) and retry.content == first.content
    assert shared_upstream.executions(path) == 1
    path, key = unique_path("puts"), new_key()
    answers = [post(tuned_envoy, path, key=key) for _ in range(2)]
    assert [a.headers["x-execution"] for a in answers] == ["1", "2"]
    assert not any(REPLAYED in a.headers for a in answers)


# --------------------------------------------------------------------------
# 3-6. the key
# --------------------------------------------------------------------------


def test_quoted_and_bare_forms_are_the_same_key(sample_envoy, shared_upstream) -> None:
    path, key = unique_path("orders"), new_key()
    first = post(sample_envoy, path, key=f'"{key}"')
    assert first.status_code == 201 and REPLAYED not in first.headers
    bare = post(sample_envoy, path, key=key)
    quoted = post(sample_envoy, path, key=f'"{key}"')
    for retry in (bare, quoted):
        assert is_replay(retry) and retry.content == first.content
    assert shared_upstream.executions(path) == 1


@pytest.mark.parametrize(
    "value, detail",
    [
        pytest.param(b"", "empty", id="empty"),
        pytest.param(b"a" * 256, "256 bytes", id="256-bytes"),
        pytest.param("caf\u00e9-key".encode(), "outside visible ASCII", id="non-ascii"),
        pytest.param(b"ab c", "outside visible ASCII", id="inner-space"),
        pytest.param(b'"abc', "structured-field string", id="unterminated-quote"),
        pytest.param(b'"ab"c', "structured-field string", id="text-after-quote"),
        pytest.param(b'"a\\nb"', "structured-field string", id="bad-escape"),
    ],
)
def test_invalid_keys_get_400_and_never_reach_the_upstream(sample_envoy, shared_upstream, value, detail) -> None:
    path = unique_path("orders")
    resp = send(sample_envoy, path, headers=[("idempotency-key", value)], body=b"{}")
    doc = problem(resp, 400, "invalid-key", rule="orders")
    assert detail in doc["detail"]
    assert "idempotency-key" in doc["detail"]
    assert shared_upstream.executions(path) == 0


def test_a_255_byte_key_is_accepted(sample_envoy, shared_upstream) -> None:
    path, key = unique_path("orders"), "k" * 255
    first = post(sample_envoy, path, key=key)
    retry = post(sample_envoy, path, key=key)
    assert first.status_code == 201 and is_replay(retry)
    assert shared_upstream.executions(path) == 1


def test_missing_key_is_refused_when_required_and_passes_when_optional(sample_envoy, tuned_envoy, shared_upstream) -> None:
    path = unique_path("orders")
    doc = problem(post(sample_envoy, path), 400, "missing-key", rule="orders")
    assert "idempotency-key" in doc["detail"]
    assert shared_upstream.executions(path) == 0

    # key.required false: no key, no protection; the request executes every time.
    path = unique_path("optional")
    answers = [post(tuned_envoy, path) for _ in range(2)]
    assert [a.status_code for a in answers] == [201, 201]
    assert [a.headers["x-execution"] for a in answers] == ["1", "2"]
    assert not any(REPLAYED in a.headers for a in answers)
    # ... but a key, when sent, still protects.
    path, key = unique_path("optional"), new_key()
    first, retry = post(tuned_envoy, path, key=key), post(tuned_envoy, path, key=key)
    assert first.status_code == 201 and is_replay(retry) and retry.content == first.content
    assert shared_upstream.executions(path) == 1


def test_custom_key_header(tuned_envoy, shared_upstream) -> None:
    path, key = unique_path("custom-key"), new_key()
    first = post(tuned_envoy, path, key=key, key_header="x-request-key")
    retry = post(tuned_envoy, path, key=key, key_header="X-Request-Key")
    assert first.status_code == 201 and REPLAYED not in first.headers
    assert is_replay(retry) and retry.content == first.content
    # The default header name means nothing to this rule.
    doc = problem(post(tuned_envoy, path, key=key), 400, "missing-key", rule="custom-key")
    assert "x-request-key" in doc["detail"]
    assert shared_upstream.executions(path) == 1


# --------------------------------------------------------------------------
# 7-9. fingerprint, in flight, concurrency
# --------------------------------------------------------------------------


def test_a_key_reused_for_another_request_gets_422_and_the_record_survives(sample_envoy, shared_upstream) -> None:
    path, other_path, key = unique_path("orders"), unique_path("orders"), new_key()
    body = b'{"amount":100}'
    first = post(sample_envoy, path, key=key, body=body)
    assert first.status_code == 201

    attempts = {
        "other body": lambda: post(sample_envoy, path, key=key, body=b'{"amount":999}'),
        "other path": lambda: post(sample_envoy, other_path, key=key, body=body),
        "other query": lambda: post(sample_envoy, path + "?page=2", key=key, body=body),
        "other method": lambda: send(sample_envoy, path, method="PATCH", key=key, body=body),
    }
    for what, attempt in attempts.items():
        resp = attempt()
        assert resp.status_code == 422, what
        doc = problem(resp, 422, "key-reused", rule="orders")
        assert "idempotency-key" in doc["detail"]

    retry = post(sample_envoy, path, key=key, body=body)
    assert is_replay(retry) and retry.status_code == 201 and retry.content == first.content
    assert shared_upstream.executions(path) == 1
    assert shared_upstream.executions(other_path) == 0


def test_a_duplicate_while_the_first_runs_gets_409_then_the_retry_replays(sample_envoy, shared_upstream) -> None:
    path, key = unique_path("orders"), new_key()
    slow = {"x-demo-delay-ms": "1500"}
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(post, sample_envoy, path, key=key, headers=slow)
        # The upstream counts before its delay: from here on the first request is in flight.
        harness.wait_until(lambda: shared_upstream.executions(path) == 1, timeout=10, what="first request upstream")
        duplicate = post(sample_envoy, path, key=key, headers=slow)
        assert not pending.done(), "the first request finished before the duplicate was answered"
        first = pending.result(timeout=20)
    problem(duplicate, 409, "request-in-flight", rule="orders")
    assert duplicate.headers["retry-after"] == "1"
    assert first.status_code == 201 and REPLAYED not in first.headers

    retry = post(sample_envoy, path, key=key, headers=slow)
    assert is_replay(retry) and retry.content == first.content
    assert shared_upstream.executions(path) == 1


def test_200_concurrent_identical_requests_execute_once(sample_envoy, shared_upstream) -> None:
    path, key = unique_path("orders"), new_key()
    body = b'{"order":"concurrent"}'
    local = threading.local()
    sessions: list[client.Session] = []
    lock = threading.Lock()

    def one(_: int) -> tuple[int, bool, bytes, str]:
        session = getattr(local, "session", None)
        if session is None:
            session = local.session = client.session()
            with lock:
                sessions.append(session)
        resp = post(sample_envoy, path, key=key, body=body, headers={"x-demo-delay-ms": "200"}, session=session)
        return resp.status_code, is_replay(resp), resp.content, resp.headers.get("content-type", "")

    try:
        with ThreadPoolExecutor(max_workers=50) as pool:
            answers = list(pool.map(one, range(200), timeout=60))
    finally:
        for session in sessions:
            session.close()

    assert len(answers) == 200
    assert shared_upstream.executions(path) == 1
    assert not [a for a in answers if a[0] >= 500], "5xx answers"
    executed = [a for a in answers if a[0] == 201 and not a[1]]
    assert len(executed) == 1, f"{len(executed)} answers came from an execution"
    original = executed[0][2]
    replays = [a for a in answers if a[1]]
    conflicts = [a for a in answers if a[0] == 409]
    assert all(a[0] == 201 and a[2] == original for a in replays)
    assert all(a[3] == "application/problem+json" for a in conflicts)
    assert 1 + len(replays) + len(conflicts) == 200, sorted({a[0] for a in answers})
    print(f"200 concurrent: 1 executed, {len(replays)} replayed, {len(conflicts)} got 409")
    final = post(sample_envoy, path, key=key, body=body)
    assert is_replay(final) and final.content == original


# --------------------------------------------------------------------------
# 10. scope
# --------------------------------------------------------------------------


def test_keys_are_scoped_per_caller_host_and_custom_headers(sample_envoy, tuned_envoy, shared_upstream) -> None:
    # Default scope (:authority, authorization): two callers with the same key.
    path, key = unique_path("orders"), new_key()
    alice = post(sample_envoy, path, key=key, headers={"authorization": "Bearer a"})
    bob = post(sample_envoy, path, key=key, headers={"authorization": "Bearer b"})
    assert not is_replay(alice) and not is_replay(bob)
    assert alice.json()["execution"] == 1 and bob.json()["execution"] == 2
    alice_retry = post(sample_envoy, path, key=key, headers={"authorization": "Bearer a"})
    bob_retry = post(sample_envoy, path, key=key, headers={"authorization": "Bearer b"})
    assert is_replay(alice_retry) and alice_retry.content == alice.content
    assert is_replay(bob_retry) and bob_retry.content == bob.content
    assert shared_upstream.executions(path) == 2

    # Different hosts are different scopes.
    path, key = unique_path("orders"), new_key()
    on_a = post(sample_envoy, path, key=key, headers={"host": "a.example"})
    on_b = post(sample_envoy, path, key=key, headers={"host": "b.example"})
    assert not is_replay(on_a) and not is_replay(on_b)
    assert on_a.json()["execution"] == 1 and on_b.json()["execution"] == 2
    assert is_replay(post(sample_envoy, path, key=key, headers={"host": "a.example"}))
    assert shared_upstream.executions(path) == 2

    # scope_headers ["x-tenant"]: tenants are separate; authorization no longer matters.
    path, key = unique_path("tenant"), new_key()
    t1 = post(tuned_envoy, path, key=key, headers={"x-tenant": "t1", "authorization": "Bearer a"})
    t2 = post(tuned_envoy, path, key=key, headers={"x-tenant": "t2", "authorization": "Bearer a"})
    assert not is_replay(t1) and not is_replay(t2)
    assert t1.json()["execution"] == 1 and t2.json()["execution"] == 2
    t1_other_caller = post(tuned_envoy, path, key=key, headers={"x-tenant": "t1", "authorization": "Bearer z"})
    assert is_replay(t1_other_caller) and t1_other_caller.content == t1.content
    assert shared_upstream.executions(path) == 2


# --------------------------------------------------------------------------
# 11. release on failure statuses
# --------------------------------------------------------------------------


# 401, 403 and 407: the upstream refused the caller, so the write never ran.
@pytest.mark.parametrize("status", [500, 503, 429, 408, 425, 401, 403, 407])
def test_releasing_statuses_are_not_recorded(sample_envoy, shared_upstream, status) -> None:
    path, key = unique_path("orders"), new_key()
    headers = {"x-demo-status": str(status)}
    answers = [post(sample_envoy, path, key=key, headers=headers) for _ in range(2)]
    assert [a.status_code for a in answers] == [status, status]
    assert [a.headers.get("x-execution") for a in answers] == ["1", "2"]
    assert not any(REPLAYED in a.headers for a in answers)
    assert shared_upstream.executions(path) == 2


@pytest.mark.parametrize("status", [404, 400, 409, 200])
def test_other_statuses_are_recorded_and_replayed(sample_envoy, shared_upstream, status) -> None:
    path, key = unique_path("orders"), new_key()
    headers = {"x-demo-status": str(status)}
    first = post(sample_envoy, path, key=key, headers=headers)
    retry = post(sample_envoy, path, key=key, headers=headers)
    assert first.status_code == retry.status_code == status
    assert is_replay(retry) and retry.content == first.content
    assert shared_upstream.executions(path) == 1


def test_custom_release_on_status(tuned_envoy, shared_upstream) -> None:
    # release_on_status ["5xx"]: a 429 is now recorded, a 503 still released.
    path, key = unique_path("only5xx"), new_key()
    first = post(tuned_envoy, path, key=key, headers={"x-demo-status": "429"})
    retry = post(tuned_envoy, path, key=key, headers={"x-demo-status": "429"})
    assert first.status_code == retry.status_code == 429
    assert is_replay(retry) and retry.content == first.content
    assert shared_upstream.executions(path) == 1

    path, key = unique_path("only5xx"), new_key()
    answers = [post(tuned_envoy, path, key=key, headers={"x-demo-status": "503"}) for _ in range(2)]
    assert [a.headers.get("x-execution") for a in answers] == ["1", "2"]
    assert not any(REPLAYED in a.headers for a in answers)


# --------------------------------------------------------------------------
# 12. responses over the cap
# --------------------------------------------------------------------------


def test_a_response_over_the_cap_is_replayed_without_its_body(tuned_envoy, shared_upstream) -> None:
    path, key = unique_path("small"), new_key()
    big = {"x-demo-body-bytes": "5000"}
    first = post(tuned_envoy, path, key=key, headers=big)
    assert first.status_code == 201
    assert len(first.content) == 5000  # the client gets the whole body the first time
    assert REPLAYED not in first.headers and BODY_OMITTED not in first.headers

    retry = post(tuned_envoy, path, key=key, headers=big)
    assert retry.status_code == 201
    assert retry.content == b""
    assert retry.headers[REPLAYED] == "true"
    assert retry.headers[BODY_OMITTED] == "true"
    # content-type is left to the test below (Envoy drops it from empty local replies).
    for name in ("x-execution", "cache-control", "x-demo-upstream"):
        assert retry.headers.get(name) == first.headers[name], name
    assert int(retry.headers["content-length"]) == 0
    assert shared_upstream.executions(path) == 1


@pytest.mark.parametrize(
    "prefix, headers",
    [
        pytest.param("small", {"x-demo-body-bytes": "5000"}, id="body-over-the-cap"),
        pytest.param("orders", {"x-demo-body-bytes": "0"}, id="recorded-empty-body"),
    ],
)
def test_a_replay_with_an_empty_body_keeps_its_content_type(tuned_envoy, sample_envoy, prefix, headers) -> None:
    """Envoy strips content-type from a local reply without a body; the filter restores the
    recorded one as its own reply passes back through it."""
    envoy = tuned_envoy if prefix == "small" else sample_envoy
    path, key = unique_path(prefix), new_key()
    first = post(envoy, path, key=key, headers=headers)
    retry = post(envoy, path, key=key, headers=headers)
    assert first.headers["content-type"] == "text/plain"
    assert is_replay(retry) and retry.content == b""
    assert retry.headers.get("content-type") == first.headers["content-type"]


def test_a_response_of_exactly_the_cap_is_replayed_whole(tuned_envoy, shared_upstream) -> None:
    path, key = unique_path("small"), new_key()
    exact = {"x-demo-body-bytes": "1024"}
    first = post(tuned_envoy, path, key=key, headers=exact)
    retry = post(tuned_envoy, path, key=key, headers=exact)
    assert len(first.content) == 1024
    assert is_replay(retry) and retry.content == first.content
    assert BODY_OMITTED not in retry.headers
    assert shared_upstream.executions(path) == 1


# --------------------------------------------------------------------------
# 13-15. time and capacity
# --------------------------------------------------------------------------


def test_a_record_expires_after_its_ttl(tuned_envoy, shared_upstream) -> None:
    path, key = unique_path("short-ttl"), new_key()
    first = post(tuned_envoy, path, key=key)
    recorded_at = time.monotonic()
    assert first.status_code == 201
    assert is_replay(post(tuned_envoy, path, key=key))
    time.sleep(max(0.0, recorded_at + 2.5 - time.monotonic()))
    again = post(tuned_envoy, path, key=key)
    assert again.status_code == 201 and not is_replay(again)
    assert again.headers["x-execution"] == "2"
    retry = post(tuned_envoy, path, key=key)
    assert is_replay(retry) and retry.content == again.content
    assert shared_upstream.executions(path) == 2


def test_a_full_table_rejects_new_keys_or_passes_them_through(envoy_with, upstream) -> None:
    # A table of one bucket (its slots, as the code lays them out, are the whole capacity):
    # every key lands in it, whatever its hash.
    slots = harness.table_geometry(1).capacity
    envoy = envoy_with(
        plugin_config(
            rule("reject", prefixes=["/reject"], lease_seconds=30),
            rule("pass", prefixes=["/pass"], on_table_full="pass_through"),
            capacity=slots,
        )
    )
    assert f"local table holds {slots} records in 1 buckets" in envoy.log_text()
    holders = [unique_path("reject") for _ in range(slots)]
    with ThreadPoolExecutor(max_workers=slots) as pool:
        pending = [pool.submit(post, envoy, p, key=new_key(), headers={"x-demo-delay-ms": "2000"}) for p in holders]
        harness.wait_until(lambda: upstream.total() == slots, timeout=10, what=f"{slots} claims in flight")

        path = unique_path("reject")
        resp = post(envoy, path, key=new_key())
        problem(resp, 503, "capacity-exhausted", rule="reject")
        assert resp.headers["retry-after"] == "1"
        assert upstream.executions(path) == 0

        path, key = unique_path("pass"), new_key()
        answers = [post(envoy, path, key=key) for _ in range(2)]
        assert [a.status_code for a in answers] == [201, 201]
        assert [a.headers["x-execution"] for a in answers] == ["1", "2"]  # unprotected
        assert not any(REPLAYED in a.headers for a in answers)

        assert [f.result(timeout=20).status_code for f in pending] == [201] * slots

    reject, passed = rule_counters(envoy, "reject"), rule_counters(envoy, "pass")
    assert (reject["table_full"], reject["executed"], reject["passed_through"]) == (1, slots, 0)
    assert (passed["table_full"], passed["passed_through"], passed["executed"]) == (2, 2, 0)


# --------------------------------------------------------------------------
# 16-17. rule selection, replay headers
# --------------------------------------------------------------------------


def test_rules_chosen_by_route_metadata_and_route_name(sample_envoy, shared_upstream, envoy_with, upstream) -> None:
    # envoy.yaml: route `payments` carries metadata idempotency.rule = payments.
    path = unique_path("payments")
    problem(post(sample_envoy, path), 400, "missing-key", rule="payments")
    key = new_key()
    first, retry = post(sample_envoy, path, key=key), post(sample_envoy, path, key=key)
    assert first.status_code == 201 and is_replay(retry) and retry.content == first.content
    problem(post(sample_envoy, path, key=key, body=b"other"), 422, "key-reused", rule="payments")
    assert shared_upstream.executions(path) == 1

    # No rule matches: untouched, even without a key, every time.
    path = unique_path("elsewhere")
    answers = [post(sample_envoy, path) for _ in range(2)]
    assert [a.status_code for a in answers] == [201, 201]
    assert [a.headers["x-execution"] for a in answers] == ["1", "2"]
    assert not any(REPLAYED in a.headers for a in answers)

    # match.route_names ["default"] alone selects the rule, on any path of that route.
    envoy = envoy_with(plugin_config(rule("by-route", match={"route_names": ["default"]})))
    path = unique_path("anything")
    problem(post(envoy, path), 400, "missing-key", rule="by-route")
    key = new_key()
    first, retry = post(envoy, path, key=key), post(envoy, path, key=key)
    assert first.status_code == 201 and is_replay(retry) and retry.content == first.content
    assert upstream.executions(path) == 1

    # The `payments` route's metadata names a rule this configuration lacks: the request
    # passes untouched (route name `payments` is not `default` either), and the log says why.
    path = unique_path("payments")
    answers = [post(envoy, path) for _ in range(2)]
    assert [a.headers["x-execution"] for a in answers] == ["1", "2"]
    assert "route metadata names rule 'payments', which is not configured" in envoy.log_text()


def test_replay_header_names_and_skipped_headers_are_configurable(tuned_envoy, shared_upstream) -> None:
    # rule `renamed`: replay_header X-Replayed, body_omitted_header X-Body-Omitted,
    # replay_skip_headers ["x-execution"] (replacing the default list), max_response_bytes 64.
    path, key = unique_path("renamed"), new_key()
    first = post(tuned_envoy, path, key=key)  # the JSON body is over 64 bytes
    assert first.status_code == 201 and len(first.content) > 64
    assert "x-replayed" not in first.headers
    retry = post(tuned_envoy, path, key=key)
    assert retry.status_code == 201 and retry.content == b""
    assert retry.headers["x-replayed"] == "true"
    assert retry.headers["x-body-omitted"] == "true"
    assert REPLAYED not in retry.headers and BODY_OMITTED not in retry.headers
    assert "x-execution" not in retry.headers
    assert retry.headers["cache-control"] == first.headers["cache-control"]
    # The list replaces the default one: set-cookie is no longer skipped.
    assert retry.headers.get("set-cookie") == first.headers["set-cookie"]

    path, key = unique_path("renamed"), new_key()
    first = post(tuned_envoy, path, key=key, headers={"x-demo-body-bytes": "10"})
    retry = post(tuned_envoy, path, key=key, headers={"x-demo-body-bytes": "10"})
    assert retry.headers["x-replayed"] == "true" and retry.content == first.content
    assert "x-body-omitted" not in retry.headers
    assert shared_upstream.executions(path) == 1


# --------------------------------------------------------------------------
# 18. refused configurations
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, logged",
    [
        pytest.param({"rules": [{"name": "a", "ttl": 5}]}, "(json): unknown field `ttl`", id="unknown-field"),
        pytest.param({"rules": [{"name": "a", "lease_seconds": 0}]}, "rules[0].lease_seconds", id="lease-0"),
        pytest.param({"rules": [{"name": "a b"}]}, "rules[0].name", id="bad-rule-name"),
        pytest.param('{"rules": [', "(json): EOF while parsing", id="invalid-json"),
        pytest.param({"rules": [{"name": "a", "execution": "detached", "upstream_cluster": ""}]},
                     "rules[0].upstream_cluster: must name an Envoy cluster", id="detached-no-cluster"),
        pytest.param({"rules": [{"name": "a", "upstream_timeout_ms": 500}]},
                     'rules[0].upstream_timeout_ms: only applies with execution: "detached"',
                     id="detached-setting-on-inline-rule"),
    ],
)
def test_an_invalid_plugin_config_stops_envoy_and_names_the_field(procs, upstream, config, logged) -> None:
    """A static listener whose filter refuses its configuration is not created: Envoy logs
    the module's reason (the Wasm build's `on_configure` returns false: `Unable to create Wasm
    plugin idempotency`; the native build's config hook refuses it), and exits with status 1
    before it is ready."""
    envoy = procs.add(harness.Envoy(harness.default_envoy_config(), procs.tmpdir, **envoy_options(upstream, config)))
    code, log = envoy.start_expecting_failure(timeout=30)
    assert code == 1, log[-2000:]
    assert f"invalid plugin configuration: {logged}" in log
    assert harness.CONFIG_REFUSED_LOG in log
    assert "starting main dispatch loop" not in log
    assert not crash_lines(log), crash_lines(log)


# --------------------------------------------------------------------------
# 19. metrics
# --------------------------------------------------------------------------


OUTCOMES = [
    "executed", "replayed", "replayed_tombstone", "conflict", "mismatch", "missing_key", "invalid_key", "missing_scope", "released",
    "passed_through", "table_full", "evicted", "kept_for_store", "body_omitted", "taken_over", "not_recorded", "table_error",
    "store_error", "store_fail_open", "store_write_dropped", "waited", "replayed_after_wait", "wait_timed_out",
    "wait_released", "outcome_unknown", "outcome_unknown_answered", "resent", "lease_lost",
    "detached", "completed_after_client_left", "grpc_streaming", "grpc_stream_with_key", "grpc_on_http_rule",
    "replay_echo_unrouted", "resolved_took_effect", "resolved_never_ran", "resolution_retried", "resolution_gave_up",
    "looked_up",
]


def test_outcome_counters_in_stats_and_prometheus(envoy_with) -> None:
    """One request per outcome. `executed` moves by 2: the request whose upstream answer
    releases its claim was executed too. `passed_through` needs a rule whose key is optional,
    so it is counted on a second rule."""
    envoy = envoy_with(
        plugin_config(
            rule("orders", prefixes=["/orders"]),
            rule("optional", prefixes=["/optional"], key={"required": False}),
        )
    )
    assert rule_counters(envoy, "orders") == dict.fromkeys(OUTCOMES, 0)

    path, key = unique_path("orders"), new_key()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(post, envoy, path, key=key, headers={"x-demo-delay-ms": "1000"})  # executed
        harness.wait_until(lambda: rule_counters(envoy, "orders")["executed"] == 1, timeout=10, what="claim")
        assert post(envoy, path, key=key).status_code == 409  # conflict
        assert pending.result(timeout=20).status_code == 201
    assert is_replay(post(envoy, path, key=key))  # replayed
    assert post(envoy, path, key=key, body=b"different").status_code == 422  # mismatch
    assert post(envoy, unique_path("orders")).status_code == 400  # missing_key
    assert post(envoy, unique_path("orders"), key='"unterminated').status_code == 400  # invalid_key
    released = post(envoy, unique_path("orders"), key=new_key(), headers={"x-demo-status": "503"})
    assert released.status_code == 503  # executed, then released
    assert post(envoy, unique_path("optional")).status_code == 201  # passed_through

    expected = {
        "orders": dict.fromkeys(OUTCOMES, 0)
        | {"executed": 2, "replayed": 1, "conflict": 1, "mismatch": 1, "missing_key": 1,
           "invalid_key": 1, "released": 1},
        "optional": dict.fromkeys(OUTCOMES, 0) | {"passed_through": 1},
    }
    harness.wait_until(
        lambda: all(rule_counters(envoy, r) == e for r, e in expected.items()), timeout=5, what="counters settled"
    )
    for rule_name, counts in expected.items():
        assert rule_counters(envoy, rule_name) == counts

    # stats_tags in envoy.yaml turn the rule into a label (on either build's names).
    text = envoy.admin("/stats/prometheus").text
    prefix = harness.PROMETHEUS_PREFIX
    assert f"# TYPE {prefix}idempotency_rule_executed counter" in text
    for rule_name, counts in expected.items():
        for outcome, value in counts.items():
            line = f'{prefix}idempotency_rule_{outcome}{{idempotency_rule="{rule_name}"}} {value}'
            assert line in text.splitlines(), line


# --------------------------------------------------------------------------
# 20. no crashes (runs last)
# --------------------------------------------------------------------------


def test_zz_no_envoy_log_shows_a_panic_or_trap() -> None:
    """Every log read during this module (the shared Envoys' up to now, and each test's own):
    no panic, no wasm trap, no failed proxy_on_* callback."""
    envoys = [proc for proc, _ in _WATCHED.values() if proc.name.startswith("envoy")]
    if not envoys:
        pytest.skip("no Envoy ran in this session")
    found = []
    for proc in envoys:
        found += [f"{proc.log_path}: {line}" for line in crash_lines(proc.log_text())]
        assert "starting main dispatch loop" in proc.log_text() or harness.CONFIG_REFUSED_LOG in proc.log_text()
    assert not found, "\n".join(found)
    print(f"checked {len(envoys)} Envoy logs")

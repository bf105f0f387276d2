"""Real third-party clients that retry on their own, against Envoy with the filter: the
retries are not the test's to time, so what the filter answers each one is what a user of
that client gets. Every test counts the demo upstream's executions.

1. **The official Stripe Python SDK** (``stripe``, pinned in tests/requirements.txt), as an
   application would use it: ``stripe.StripeClient`` with a dummy key, its ``api`` base
   address pointed at Envoy, ``max_network_retries`` set and the SDK's own
   ``stripe.RequestsClient`` with a short ``timeout``. The SDK is the real one; the HTTP
   client is subclassed only to note each attempt (``RecordingClient``). What the installed
   SDK does (read from stripe/_http_client.py and stripe/_api_requestor.py, 16.1.0):

   - **When it retries** (``HTTPClient._should_retry``), at most ``max_network_retries``
     times: a ``requests`` timeout or connection error (``RequestsClient._handle_request_error``
     marks ``Timeout`` and ``ConnectionError`` retryable, SSL errors not); else the response
     header ``Stripe-Should-Retry`` decides if present (``false``: never, ``true``: always);
     else a ``409``; else any status ``>= 500``. Nothing else (a 4xx other than 409 is final).
   - **How long it waits**: 0.5 s x 2^(n-1), jittered to [half, whole], at least 0.5 s, at
     most 5 s. It never reads ``Retry-After``.
   - **The key**: ``_APIRequestor.request_headers`` sets ``Idempotency-Key`` on every POST,
     once per call (a random UUID-shaped value, or the call's ``idempotency_key`` option),
     before ``request_with_retries`` loops: every attempt of one call carries the same key and
     the same form-encoded body bytes (asserted below from the recorded attempts).
   - **What the call finally raises**: a non-2xx answer whose JSON has no ``error`` object
     (the filter's problem+json, the demo upstream's JSON) is ``stripe.APIError`` with
     ``http_status``, ``json_body`` (the parsed problem), ``headers`` and the message
     "Invalid response object from API"; a timeout on the last attempt is
     ``stripe.APIConnectionError``.

   So with the filter: a retry of a write that is still running gets ``409``
   ``request-in-flight`` (the SDK retries it, ignoring its ``Retry-After: 1``); a write whose
   outcome is unknown (the SDK's own timeout made it hang up after the request went upstream,
   or Envoy's route timeout answered 504) leaves ``409`` ``outcome-unknown``, which the SDK
   retries until its retry limit and then raises: never a second execution. On a rule that
   resolves unknown outcomes (``resolve``), the SDK's retries go on until the filter has looked
   the payment up, and the call returns it. The upstream's own 500 releases the key, so each
   retry the SDK makes executes again.

2. **nginx as the load balancer** in front of two Envoy replicas in cluster mode sharing one
   store: ``proxy_next_upstream error timeout non_idempotent`` with a 1 s
   ``proxy_read_timeout`` re-sends a POST that timed out on one replica to the other, the
   classic way a load balancer runs a payment twice. Checked in nginx's own logs that it really
   did re-send. Then both retriers at once: the SDK through nginx to the two replicas.

Single-proxy Envoys come from envoy/envoy.yaml with the sample's plugin configuration minus
its ``store`` section plus one rule for the SDK's path; the cluster from envoy/envoy.yaml as it
is (store callout budget raised, as in test_cluster.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import pytest
import requests
import stripe

import client
import harness
from cluster import BODY, HOST, cluster_plugin_config, start_cluster
from cluster import post as cluster_post
from helpers import (
    needs_route_cluster,
    PROBLEM_TYPE_BASE,
    REPLAYED,
    access_lines,
    crash_lines,
    new_key,
    prepend_routes,
    problem,
    rule,
    rule_counter,
    rule_counters,
    sample_single_proxy_config,
    start_envoy,
    unique_path,
)

API_KEY = "sk_test_idempotency_filter_e2e"  # a dummy: the demo upstream checks nothing
INTENTS = "/v1/payment_intents"  # what client.v1.payment_intents.create() posts to
SHORT = "/short"  # route timeout 1 s (the SDK's base address carries the prefix)
RETRIED = "/retried"  # a route retry policy of its own: 5xx,reset x2, per-try timeout 1 s
RULE = "stripe"
PARAMS = {"amount": 2000, "currency": "usd", "payment_method_types": ["card"],
          "metadata": {"order": "order-42"}}
DELAY_MS = 2500  # longer than the SDK's 1 s timeout and the short routes, shorter than 15 s
OUTCOME_UNKNOWN = PROBLEM_TYPE_BASE + "outcome-unknown"
IN_FLIGHT = PROBLEM_TYPE_BASE + "request-in-flight"


# --------------------------------------------------------------------------
# the SDK, pointed at Envoy
# --------------------------------------------------------------------------


@dataclass
class SdkAttempt:
    """One HTTP attempt the SDK made (its retries included)."""

    sent: float
    url: str
    key: str | None
    body: Any
    ended: float = 0.0
    status: int | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    content: bytes = b""
    error: str | None = None  # the SDK's APIConnectionError, e.g. a read timeout

    @property
    def problem_type(self) -> str | None:
        if self.headers.get("content-type") != "application/problem+json":
            return None
        return json.loads(self.content).get("type")

    def describe(self) -> str:
        what = self.error or f"{self.status} {self.problem_type or self.content[:60]!r}"
        return f"+{self.ended - self.sent:.2f}s {what}"


class RecordingClient(stripe.RequestsClient):
    """The SDK's own requests-based HTTP client, noting every attempt it is asked to make;
    the retry loop around it (``request_with_retries``) is the SDK's, untouched."""

    def __init__(self, timeout: float) -> None:
        session = requests.Session()
        session.trust_env = False  # loopback only, whatever proxy the environment names
        super().__init__(timeout=timeout, session=session)
        self.attempts: list[SdkAttempt] = []

    def request(self, method: str, url: str, headers: Any, post_data: Any = None) -> Any:
        attempt = SdkAttempt(sent=time.monotonic(), url=url,
                             key=dict(headers or {}).get("Idempotency-Key"), body=post_data)
        self.attempts.append(attempt)
        try:
            content, status, rheaders = super().request(method, url, headers, post_data)
        except stripe.APIConnectionError as err:
            attempt.error = f"APIConnectionError: {str(err).splitlines()[-1]}"
            raise
        finally:
            attempt.ended = time.monotonic()
        attempt.status, attempt.headers, attempt.content = status, rheaders, content
        return content, status, rheaders

    def summary(self) -> list[str]:
        return [a.describe() for a in self.attempts]


@dataclass
class Api:
    envoy: harness.Envoy
    upstream: harness.Upstream

    def sdk(self, *, timeout: float, retries: int, prefix: str = "") -> tuple[stripe.StripeClient, RecordingClient]:
        http = RecordingClient(timeout)
        base = f"http://{harness.LOOPBACK}:{self.envoy.port}{prefix}"
        sdk = stripe.StripeClient(API_KEY, base_addresses={"api": base},
                                  max_network_retries=retries, http_client=http)
        return sdk, http

    def counters(self) -> dict[str, int]:
        return rule_counters(self.envoy, RULE)


def add_routes(config: dict) -> None:
    """``mutate`` for envoy/envoy.yaml: the SHORT and RETRIED routes ahead of the catch-all."""
    prepend_routes(config, [
        {"name": "short", "match": {"prefix": SHORT + "/"},
         "route": {"cluster": "demo_upstream", "timeout": "1s"}},
        {"name": "retried", "match": {"prefix": RETRIED + "/"},
         "route": {"cluster": "demo_upstream", "timeout": "10s",
                   "retry_policy": {"retry_on": "5xx,reset", "num_retries": 2,
                                    "per_try_timeout": "1s"}}},
    ])


def stripe_plugin_config(**fields: Any) -> dict:
    """The sample's single-proxy configuration plus a rule for the SDK's path on each route
    (the key is required: the SDK always sends one; the default body fingerprint fits, since
    every retry resends the same bytes)."""
    config = sample_single_proxy_config()
    config["rules"].append(rule(RULE, prefixes=[INTENTS, SHORT + INTENTS, RETRIED + INTENTS],
                                key={"required": True}, **fields))
    return config


@pytest.fixture
def api(procs: harness.ProcessGroup) -> Iterator[Api]:
    upstream = procs.upstream()
    envoy = start_envoy(procs, upstream, stripe_plugin_config(), name="envoy-stripe", mutate=add_routes)
    yield Api(envoy, upstream)
    assert not crash_lines(envoy.log_text())


def assert_one_key_one_body(http: RecordingClient) -> str:
    """Every attempt of the call carried the same Idempotency-Key and the same body."""
    keys = {a.key for a in http.attempts}
    assert len(keys) == 1 and None not in keys, keys
    assert len({a.body for a in http.attempts}) == 1
    return http.attempts[0].key  # type: ignore[return-value]


def assert_sdk_outcome_unknown(err: stripe.APIError) -> None:
    """What the application finally gets from the SDK for a write whose outcome is unknown."""
    assert err.http_status == 409, (err.http_status, err.http_body)
    assert "Invalid response object from API" in str(err), str(err)
    assert err.json_body["type"] == OUTCOME_UNKNOWN, err.json_body
    assert err.json_body["rule"] == RULE, err.json_body
    assert "retry-after" not in {k.lower() for k in (err.headers or {})}, dict(err.headers or {})


def sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


# --------------------------------------------------------------------------
# 1. the Stripe SDK
# --------------------------------------------------------------------------


def test_sdk_call_is_recorded_and_a_second_call_with_its_key_gets_the_replay(api) -> None:
    """The baseline: nothing goes wrong, the SDK makes one attempt; the application repeats the
    call with the same key (say, after its own crash) and the SDK hands it the same object."""
    sdk, http = api.sdk(timeout=5, retries=2)
    intent = sdk.v1.payment_intents.create(params=PARAMS)
    assert intent["execution"] == 1 and intent["path"] == INTENTS, intent
    assert intent.last_response.code == 201
    key = assert_one_key_one_body(http)
    assert len(http.attempts) == 1

    again = sdk.v1.payment_intents.create(params=PARAMS, options={"idempotency_key": key})
    assert again.to_dict() == intent.to_dict()
    assert again.last_response.headers[REPLAYED] == "true"
    assert api.upstream.executions(INTENTS) == 1
    assert api.counters()["executed"] == 1


def test_sdk_that_times_out_and_retries_gets_outcome_unknown_and_the_write_runs_once(api) -> None:
    """(a) The upstream takes 2.5 s, the SDK's timeout is 1 s (Envoy's route: 15 s). The SDK
    hangs up and retries with the same key: its hang-up came after the router's attempt, so
    the filter records an unknown outcome, and every retry (and a later call with the key)
    gets 409 outcome-unknown; the SDK retries those 409s to its limit, then raises
    APIError(409). One execution."""
    sdk, http = api.sdk(timeout=1.0, retries=3)
    with pytest.raises(stripe.APIError) as caught:
        sdk.v1.payment_intents.create(params=PARAMS, options={"headers": {"x-demo-delay-ms": str(DELAY_MS)}})
    summary = http.summary()
    key = assert_one_key_one_body(http)
    first, *retries = http.attempts
    assert first.error and "Read timed out" in first.error, summary
    assert len(retries) == 3, summary
    types = [a.problem_type for a in retries]
    assert all(a.status == 409 for a in retries), summary
    # The hang-up is recorded at once: the first retry, 0.5 s later, already finds it. A
    # 409 in flight (with Retry-After) before it would be right too, never after it.
    assert set(types) <= {IN_FLIGHT, OUTCOME_UNKNOWN}, summary
    assert types[-1] == OUTCOME_UNKNOWN and IN_FLIGHT not in types[types.index(OUTCOME_UNKNOWN):], summary
    for a in retries:
        if a.problem_type == OUTCOME_UNKNOWN:
            assert "retry-after" not in {k.lower() for k in a.headers}, dict(a.headers)
    assert_sdk_outcome_unknown(caught.value)

    # The upstream finished the write meanwhile (its answer had nowhere to go).
    sleep_until(first.sent + DELAY_MS / 1000 + 0.5)
    assert api.upstream.executions(INTENTS) == 1

    # The application tries again later with the same key: told the same, nothing runs.
    with pytest.raises(stripe.APIError) as later:
        sdk.v1.payment_intents.create(params=PARAMS, options={"idempotency_key": key,
                                                              "max_network_retries": 0})
    assert_sdk_outcome_unknown(later.value)
    assert api.upstream.executions(INTENTS) == 1
    counters = api.counters()
    assert counters["executed"] == 1 and counters["outcome_unknown"] == 1, counters
    assert counters["outcome_unknown_answered"] == types.count(OUTCOME_UNKNOWN) + 1, counters
    assert counters["released"] == 0 and counters.get("resent", 0) == 0, counters


@needs_route_cluster
def test_sdk_that_times_out_keeps_retrying_until_it_receives_its_charge(procs) -> None:
    """(a) again, on a rule that resolves unknown outcomes (``resolve``: the payment looked up
    at ``GET /v1/payment_intents/by-key/{key}`` 3 s after the hang-up, with the SDK's own
    Authorization). The SDK's retries get 409 outcome-unknown with Retry-After until the
    lookup found the payment; the next retry gets the payment itself, and the call returns it
    as if nothing had happened. One execution."""
    upstream = procs.upstream()
    config = stripe_plugin_config(resolve={"path": INTENTS + "/by-key/{key}", "settle_seconds": 3})
    envoy = start_envoy(procs, upstream, config, name="envoy-stripe-resolve", mutate=add_routes)
    sdk, http = Api(envoy, upstream).sdk(timeout=1.0, retries=10)
    intent = sdk.v1.payment_intents.create(params=PARAMS, options={"headers": {"x-demo-delay-ms": str(DELAY_MS)}})
    summary = http.summary()
    assert_one_key_one_body(http)
    first, *retries, last = http.attempts
    assert first.error and "Read timed out" in first.error, summary
    assert retries and all(a.status == 409 for a in retries), summary
    assert retries[-1].problem_type == OUTCOME_UNKNOWN and "retry-after" in retries[-1].headers, summary
    assert last.status == 200 and last.headers["idempotent-resolved"] == "true", summary
    assert last.ended - first.sent >= 3.0, summary  # not before the settle time
    assert intent["execution"] == 1 and intent["path"] == INTENTS, intent
    assert upstream.executions(INTENTS) == 1
    counters = rule_counters(envoy, RULE)
    assert counters["resolved_took_effect"] == 1 and counters["executed"] == 1, counters
    assert not crash_lines(envoy.log_text())


@pytest.mark.parametrize("prefix", [SHORT, RETRIED], ids=["route-timeout", "per-try-timeout-retry-policy"])
def test_sdk_retrying_envoys_504_gets_outcome_unknown_and_the_write_runs_once(api, prefix) -> None:
    """(b) Envoy gives up first: a 1 s route timeout, or a route retry policy (5xx,reset x2)
    with a 1 s per-try timeout that would itself send the POST three times. Envoy answers 504
    once (the filter capped the router at no retry); the SDK (timeout 5 s) retries the 5xx
    with the same key, then the 409s, and raises APIError(409) outcome-unknown."""
    sdk, http = api.sdk(timeout=5.0, retries=3, prefix=prefix)
    path = prefix + INTENTS
    with pytest.raises(stripe.APIError) as caught:
        sdk.v1.payment_intents.create(params=PARAMS, options={"headers": {"x-demo-delay-ms": str(DELAY_MS)}})
    summary = http.summary()
    assert_one_key_one_body(http)
    first, *retries = http.attempts
    assert first.status == 504 and first.content == b"upstream request timeout", summary
    assert 0.9 <= first.ended - first.sent < 2.0, summary  # one 1 s try, not three
    assert len(retries) == 3 and all(a.status == 409 and a.problem_type == OUTCOME_UNKNOWN
                                     for a in retries), summary
    assert_sdk_outcome_unknown(caught.value)

    sleep_until(first.sent + DELAY_MS / 1000 + 0.5)
    assert api.upstream.executions(path) == 1, "neither the router nor the SDK ran it again"
    counters = api.counters()
    assert counters["executed"] == 1 and counters["outcome_unknown"] == 1, counters
    assert counters["outcome_unknown_answered"] == 3, counters
    assert counters["released"] == 0 and counters.get("resent", 0) == 0, counters


@pytest.mark.parametrize("should_retry", [None, "false"], ids=["sdk-retries-5xx", "stripe-should-retry-false"])
def test_sdk_retrying_the_upstreams_own_500_executes_each_time(api, should_retry) -> None:
    """(c) The upstream itself answers 500 (``x-demo-status``, sent through the SDK's
    per-request ``headers`` option): the write failed, the key is released, so every retry the
    SDK makes executes again, 1 + max_network_retries times; with the upstream's
    ``Stripe-Should-Retry: false`` the SDK does not retry at all. The next call with the key
    (the upstream healthy now) executes once more and is recorded: the one after is a replay."""
    retries = 2
    sdk, http = api.sdk(timeout=5.0, retries=retries)
    headers = {"x-demo-status": "500"}
    if should_retry:
        headers["x-demo-header"] = f"stripe-should-retry={should_retry}"
    with pytest.raises(stripe.APIError) as caught:
        sdk.v1.payment_intents.create(params=PARAMS, options={"headers": headers})
    summary = http.summary()
    key = assert_one_key_one_body(http)
    tries = 1 if should_retry == "false" else 1 + retries
    assert len(http.attempts) == tries, summary
    assert [a.status for a in http.attempts] == [500] * tries, summary
    assert [json.loads(a.content)["execution"] for a in http.attempts] == list(range(1, tries + 1))
    assert caught.value.http_status == 500
    assert api.upstream.executions(INTENTS) == tries

    done = sdk.v1.payment_intents.create(params=PARAMS, options={"idempotency_key": key})
    assert done["execution"] == tries + 1 and done.last_response.code == 201
    replay = sdk.v1.payment_intents.create(params=PARAMS, options={"idempotency_key": key})
    assert replay.to_dict() == done.to_dict() and replay.last_response.headers[REPLAYED] == "true"
    assert api.upstream.executions(INTENTS) == tries + 1
    counters = api.counters()
    assert counters["released"] == tries and counters["executed"] == tries + 1, counters
    assert counters["outcome_unknown"] == 0, counters


# --------------------------------------------------------------------------
# 2. nginx re-sending a timed-out POST to the other replica (and the SDK behind it)
# --------------------------------------------------------------------------

LB_DIRECTIVES = (
    "proxy_http_version 1.1;",  # nginx's default 1.0 is refused by Envoy (426)
    'proxy_set_header Connection "";',
    f"proxy_set_header Host {HOST};",  # the cluster tests' Host: part of the key's scope
    "proxy_read_timeout 1s;",
    "proxy_next_upstream error timeout non_idempotent;",  # POSTs too: the dangerous setting
    "proxy_next_upstream_tries 2;",
)


@pytest.mark.parametrize("on_in_flight", ["conflict", "wait"])
def test_nginx_resending_a_timed_out_post_to_the_other_replica_runs_it_once(procs, on_in_flight) -> None:
    """nginx times out on the first replica after 1 s and re-sends the POST to the second.
    The first replica's client (nginx) hung up after its router's attempt: an unknown outcome,
    recorded in the store. The second replica finds the key in the store: still in flight (409
    request-in-flight, Retry-After) if it asks before that record lands, else (and in wait
    mode, where it holds the duplicate until the first ends) 409 outcome-unknown; nginx hands
    that 409 to the client (it re-sends only on errors and timeouts). Every later retry,
    through nginx or straight to either replica, gets 409 outcome-unknown. One execution."""
    fields = {"on_in_flight": "wait", "wait_ms": 5000} if on_in_flight == "wait" else {}
    cluster = start_cluster(procs, plugin=cluster_plugin_config(timeout_ms=2000, **fields))
    ports = [e.port for e in cluster.envoys]
    # max_fails=0: a timed-out replica stays in rotation, so later retries reach both.
    lb = procs.nginx(servers=ports, server_params="max_fails=0", proxy_directives=LB_DIRECTIVES)
    path, key = unique_path(), new_key()
    headers = {"idempotency-key": key, "content-type": "application/json"}

    started = time.monotonic()
    first = client.post(lb.url(path), body=BODY, headers={**headers, "x-demo-delay-ms": str(DELAY_MS)},
                        timeout=10)
    took = time.monotonic() - started

    # nginx really re-sent it: both replicas in $upstream_addr, the first one timed out.
    entry = harness.wait_until(lambda: next((e for e in lb.access_entries()
                                             if e["request"].startswith(f"POST {path} ")), None),
                               timeout=5, what="nginx's access log line")
    tried = [addr.strip() for addr in entry["upstream_addr"].split(",")]
    assert len(tried) == 2 and set(tried) == {f"{harness.LOOPBACK}:{p}" for p in ports}, entry
    assert entry["upstream_status"].split(", ")[0] == "504", entry  # nginx's own, for the timeout
    timed_out = [line for line in lb.error_log_text().splitlines()
                 if "upstream timed out" in line and "while reading response header from upstream" in line
                 and f'upstream: "http://{tried[0]}{path}"' in line]
    assert len(timed_out) == 1, lb.error_log_text()[-2000:]
    first_replica = cluster.envoys[ports.index(int(tried[0].rsplit(":", 1)[1]))]
    second_replica = next(e for e in cluster.envoys if e is not first_replica)
    # The first replica saw its client (nginx) go away after the router's attempt.
    logged = harness.wait_until(lambda: [e for e in access_lines(first_replica) if e["path"] == path],
                                timeout=10, what="the first replica's access log line")
    assert len(logged) == 1, logged
    assert logged[0]["flags"] == "DC" and logged[0]["idempotency_outcome"] == "executed+outcome_unknown", logged

    # What the client got: the second replica's 409, about 1 s after it sent the request.
    assert first.status_code == 409, (first.status_code, first.content[:300], entry)
    kinds = {"outcome-unknown"} if on_in_flight == "wait" else {"request-in-flight", "outcome-unknown"}
    doc = json.loads(first.content)
    assert doc["type"] in {PROBLEM_TYPE_BASE + k for k in kinds}, (doc, entry)
    kind = doc["type"][len(PROBLEM_TYPE_BASE):]
    problem(first, 409, kind, rule="orders")
    assert (first.headers.get("retry-after") == "1") == (kind == "request-in-flight"), dict(first.headers)
    assert entry["upstream_status"] == "504, 409", entry
    assert took < 2.5, took

    harness.wait_until(lambda: rule_counter(first_replica, "orders", "outcome_unknown") == 1,
                       timeout=10, what="the first replica to record the hang-up as an unknown outcome")
    sleep_until(started + DELAY_MS / 1000 + 0.5)  # the write has completed upstream, unseen
    assert cluster.upstream.executions(path) == 1

    # The client retries later: through nginx (round robin: each replica once) and directly.
    later = [client.post(lb.url(path), body=BODY, headers=headers, timeout=10) for _ in range(2)]
    later += [cluster_post(envoy, path, key) for envoy in cluster.envoys]
    for resp in later:
        problem(resp, 409, "outcome-unknown", rule="orders")
        assert "retry-after" not in resp.headers, dict(resp.headers)
    assert cluster.upstream.executions(path) == 1
    counters = [rule_counters(e, "orders") for e in cluster.envoys]
    assert sum(c["executed"] for c in counters) == 1, counters
    assert sum(c["outcome_unknown"] for c in counters) == 1, counters
    assert sum(c.get("taken_over", 0) for c in counters) == 0, counters
    assert rule_counter(second_replica, "orders", "executed") == 0, counters
    for envoy in cluster.envoys:
        assert not crash_lines(envoy.log_text(), vm_failures=True), envoy.name


def test_sdk_behind_nginx_retries_on_the_other_replica_and_the_write_runs_once(procs) -> None:
    """Both retriers at once: the Stripe SDK (timeout 1 s, 3 retries) through nginx (round
    robin, no re-sending of its own) to two replicas sharing a store. The SDK's hang-up reaches
    the first replica through nginx (nginx gives up on its upstream request when its client
    leaves: 499 in its log), an unknown outcome in the store; the retries alternate between
    the replicas and all get 409 outcome-unknown; the SDK raises APIError(409). One execution."""
    plugin = cluster_plugin_config(timeout_ms=2000, extra_rules=[
        rule(RULE, prefixes=[INTENTS], key={"required": True})])
    cluster = start_cluster(procs, plugin=plugin)
    lb = procs.nginx(servers=[e.port for e in cluster.envoys], server_params="max_fails=0",
                     proxy_directives=[d for d in LB_DIRECTIVES if "next_upstream" not in d
                                       and "read_timeout" not in d])
    http = RecordingClient(1.0)
    sdk = stripe.StripeClient(API_KEY, base_addresses={"api": f"http://{harness.LOOPBACK}:{lb.port}"},
                              max_network_retries=3, http_client=http)
    with pytest.raises(stripe.APIError) as caught:
        sdk.v1.payment_intents.create(params=PARAMS, options={"headers": {"x-demo-delay-ms": str(DELAY_MS)}})
    summary = http.summary()
    assert_one_key_one_body(http)
    first, *retries = http.attempts
    assert first.error and "Read timed out" in first.error, summary
    assert len(retries) == 3 and all(a.problem_type == OUTCOME_UNKNOWN for a in retries), summary
    assert_sdk_outcome_unknown(caught.value)

    entries = harness.wait_until(lambda: (lambda es: es if len(es) == 4 else None)(
        [e for e in lb.access_entries() if e["request"].startswith(f"POST {INTENTS} ")]),
        timeout=5, what="nginx's four access log lines")
    assert [e["status"] for e in entries] == ["499", "409", "409", "409"], entries
    assert len({e["upstream_addr"] for e in entries}) == 2, entries  # both replicas answered
    sleep_until(first.sent + DELAY_MS / 1000 + 0.5)
    assert cluster.upstream.executions(INTENTS) == 1
    counters = [rule_counters(e, RULE) for e in cluster.envoys]
    assert sum(c["executed"] for c in counters) == 1, counters
    assert sum(c["outcome_unknown"] for c in counters) == 1, counters
    assert sum(c["outcome_unknown_answered"] for c in counters) == 3, counters
    for envoy in cluster.envoys:
        assert not crash_lines(envoy.log_text(), vm_failures=True), envoy.name

"""gRPC unary writes through real Envoy, with grpcio's client (and its retry policy) in front
of a real grpcio server: one execution per key, and every retry gets the original status,
message and metadata back; the filter's own answers are gRPC statuses. Single-proxy, then
two Envoys sharing a store."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import yaml

import harness
from cluster import start_backend
from grpc_calls import (
    TOKEN,
    call,
    channel,
    grpc_envoy,
    new_key,
    plugin_config,
    recorded_copy,
    retry_policy,
    route_timeout,
    start_envoy,
    start_server,
    upstream_never_learns_the_deadline,
    with_store,
)
from helpers import crash_lines, rule_counter, rule_counters, start_refusing_h2_server, wasm_path

REPLAYED = "idempotent-replayed"
PLACE_ORDER = "/shop.v1.Orders/PlaceOrder"
PROBLEM = "idempotency-problem-type"


@pytest.fixture
def server(procs):
    return start_server(procs)


@pytest.fixture
def edge(procs, server):
    envoy = start_envoy(procs, server)
    yield envoy
    assert crash_lines(envoy.process.log_text()) == []


def problem_of(answer) -> str:
    return str(answer.trailing.get(PROBLEM, "")).rsplit(":", 1)[-1]


# --------------------------------------------------------------------------
# single proxy
# --------------------------------------------------------------------------


def test_a_retry_gets_the_recorded_message_metadata_and_trailers(edge, server) -> None:
    key = new_key()
    first = call(edge, key)
    assert first.code == grpc.StatusCode.OK and first.message == b"placed:order:1"
    retry = call(edge, key)
    assert recorded_copy(retry) == recorded_copy(first)
    assert retry.initial[REPLAYED] == "true" and REPLAYED not in first.initial
    assert retry.trailing["x-bin-bin"] == bytes([0, 1, 2, 1])
    assert server.executions(key) == 1
    assert rule_counter(edge, "orders", "replayed") == 1


def test_a_large_message_is_replayed_whole(edge, server) -> None:
    key = new_key()
    order = bytes(range(256)) * 3000  # 768,000 bytes, within the rule's 1 MiB
    first = call(edge, key, order)
    retry = call(edge, key, order)
    assert first.code == retry.code == grpc.StatusCode.OK
    assert retry.message == first.message and len(retry.message) > len(order)
    assert retry.initial[REPLAYED] == "true"
    assert server.executions(key) == 1


def test_an_error_is_replayed_with_its_status_details_and_metadata(edge, server) -> None:
    key = new_key()
    md = [("x-test-status", "5")]
    first = call(edge, key, metadata=md)
    assert first.code == grpc.StatusCode.NOT_FOUND
    retry = call(edge, key, metadata=md)
    assert (retry.code, retry.details) == (first.code, "refused on execution 1")
    # Without a message the replay is trailers-only: the initial metadata comes with the trailers.
    assert retry.trailing["grpc-status-details-bin"] == first.trailing["grpc-status-details-bin"]
    assert retry.trailing["x-trailer"] == "failed-1"
    assert retry.trailing["x-order-id"] == first.initial["x-order-id"]
    assert retry.trailing[REPLAYED] == "true"
    assert server.executions(key) == 1


def test_a_transient_status_leaves_the_call_retryable(edge, server) -> None:
    key = new_key()
    md = [("x-test-unavailable-first", "1")]
    assert call(edge, key, metadata=md).code == grpc.StatusCode.UNAVAILABLE
    second = call(edge, key, metadata=md)
    assert second.code == grpc.StatusCode.OK and second.message == b"placed:order:1"
    third = call(edge, key, metadata=md)
    assert third.message == second.message and third.initial[REPLAYED] == "true"
    assert (server.attempts(key), server.executions(key)) == (2, 1)
    assert rule_counter(edge, "orders", "released") == 1


def the_filters_answers_are_grpc_statuses(envoy, server) -> None:
    """No key: INVALID_ARGUMENT; in flight: ABORTED with pushback; another message under the
    key: INVALID_ARGUMENT. The call ran once."""
    missing = call(envoy, None)
    assert missing.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "idempotency key" in missing.details and problem_of(missing) == "missing-key"

    key = new_key()
    with harness_thread(lambda: call(envoy, key, metadata=[("x-test-sleep-ms", "1500")])) as first:
        harness.wait_until(lambda: server.attempts(key) == 1, timeout=10, what="first call running")
        busy = call(envoy, key)
        assert busy.code == grpc.StatusCode.ABORTED and problem_of(busy) == "request-in-flight"
        assert busy.trailing["grpc-retry-pushback-ms"] == "1000"
    assert first.result.code == grpc.StatusCode.OK

    other = call(envoy, key, b"another order")
    assert other.code == grpc.StatusCode.INVALID_ARGUMENT and problem_of(other) == "key-reused"
    assert server.executions(key) == 1


def test_the_filters_answers_are_grpc_statuses(edge, server) -> None:
    the_filters_answers_are_grpc_statuses(edge, server)


def retry_policy_through_a_call_in_flight(first, then, server) -> None:
    """A call running on ``first`` (0.8 s) and its duplicate on ``then`` from a client whose
    policy retries ABORTED: the duplicate's ABORTED carries pushback, the policy waits it, then
    gets the replay; the call ran once."""
    key = new_key()
    retrying = channel(then, retry_policy(["ABORTED"]))
    with harness_thread(lambda: call(first, key, metadata=[("x-test-sleep-ms", "800")])) as running:
        harness.wait_until(lambda: server.attempts(key) == 1, timeout=10, what="first call running")
        duplicate = call(retrying, key)
    assert duplicate.code == grpc.StatusCode.OK
    assert duplicate.message == running.result.message == b"placed:order:1"
    assert duplicate.initial[REPLAYED] == "true"
    assert server.executions(key) == 1
    assert rule_counter(then, "orders", "conflict") >= 1


def test_a_client_retry_policy_waits_out_a_call_in_flight_and_gets_its_answer(edge, server) -> None:
    retry_policy_through_a_call_in_flight(edge, edge, server)


def test_a_client_retry_policy_over_a_transient_failure_executes_once(edge, server) -> None:
    key = new_key()
    retrying = channel(edge, retry_policy(["UNAVAILABLE"]))
    answer = call(retrying, key, metadata=[("x-test-unavailable-first", "1")])
    assert answer.code == grpc.StatusCode.OK
    assert (server.attempts(key), server.executions(key)) == (2, 1)
    assert call(retrying, key).initial[REPLAYED] == "true"
    assert server.executions(key) == 1


def test_a_call_whose_stream_the_upstream_refused_is_retried_by_the_client_policy_and_runs_once(procs) -> None:
    """The service refuses the call's HTTP/2 stream unprocessed (RST_STREAM REFUSED_STREAM):
    Envoy answers UNAVAILABLE, the key is released, and the client policy's retry runs the
    call, instead of FAILED_PRECONDITION outcome-unknown until the TTL."""
    refusing = start_refusing_h2_server(procs)
    envoy = start_envoy(procs, refusing)
    key = new_key()
    answer = call(channel(envoy, retry_policy(["UNAVAILABLE"])), key)
    assert answer.code == grpc.StatusCode.OK and answer.message == b"placed:1", answer
    assert call(envoy, key).initial[REPLAYED] == "true"
    assert (refusing.refused(key), refusing.executions(key)) == (1, 1)
    assert rule_counter(envoy, "orders", "released") == 1
    assert rule_counter(envoy, "orders", "outcome_unknown") == 0
    assert crash_lines(envoy.process.log_text()) == []


def test_a_route_timeout_retried_by_the_client_policy_is_not_run_again(procs, server) -> None:
    """Envoy gives up after 0.5 s and answers UNAVAILABLE, which the client's policy retries:
    the first call may complete (it does, at 1.5 s), so the retry is told, never run."""
    envoy = start_envoy(procs, server, mutate=route_timeout(0.5))
    key = new_key()
    retrying = channel(envoy, retry_policy(["UNAVAILABLE"]))
    answer = call(retrying, key, metadata=[("x-test-sleep-ms", "1500")])
    assert answer.code == grpc.StatusCode.FAILED_PRECONDITION, answer
    assert problem_of(answer) == "outcome-unknown"
    time.sleep(1.5)
    assert server.executions(key) == 1
    assert call(envoy, key).code == grpc.StatusCode.FAILED_PRECONDITION
    assert server.executions(key) == 1
    assert rule_counter(envoy, "orders", "outcome_unknown") == 1


def deadline_then_retry(first, then, server) -> None:
    """A call whose 1 s deadline passes while it runs (3 s) on ``first``, then its retry
    on ``then``: the retry is told the outcome is unknown, and the call ran once. (The
    deadline leaves a loaded machine time to bring the call to the service: one that
    expired on the way would be a call that never reached it, another test.)"""
    key = new_key()
    md = [("x-test-sleep-ms", "3000")]
    assert call(first, key, metadata=md, timeout=1.0).code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert server.attempts(key) == 1, "the call reached the service before its deadline"
    harness.wait_until(lambda: server.executions(key) == 1, timeout=10, what="the service ran it")
    # The filter records the unknown outcome when Envoy ends the call's stream, which on a
    # loaded machine can come seconds after the client gave up; in cluster mode the record
    # then goes to the store from the root. Until both happened a retry is told the call is
    # in flight (ABORTED), as a client retrying at once would be: never run again.
    retry = answer_once_settled(lambda: call(then, key, metadata=md), timeout=30)
    counters = {k: v for k, v in rule_counters(first, "orders").items() if v}
    assert (retry.code, problem_of(retry)) == (grpc.StatusCode.FAILED_PRECONDITION,
                                               "outcome-unknown"), (retry.code, counters)
    assert counters.get("outcome_unknown") == 1, counters
    assert server.executions(key) == 1


# Run alone (`make e2e`, after the parallel pass): with three test files at a time on two
# cores, the first call's end sometimes did not reach the filter 30 s after its client gave
# up (the rule counted only `executed`), a retry meanwhile being told it is in flight. Not
# understood yet; one at a time it has always passed.
@pytest.mark.alone
def test_a_deadline_shorter_than_the_call_then_a_retry_never_runs_it_twice(procs, server) -> None:
    envoy = start_envoy(procs, server, mutate=upstream_never_learns_the_deadline)
    deadline_then_retry(envoy, envoy, server)
    assert crash_lines(envoy.process.log_text()) == []


def test_wait_mode_answers_a_duplicate_with_the_first_calls_response(procs, server) -> None:
    envoy = start_envoy(procs, server, plugin_config(on_in_flight="wait", wait_ms=5000))
    key = new_key()
    with harness_thread(lambda: call(envoy, key, metadata=[("x-test-sleep-ms", "800")])) as first:
        harness.wait_until(lambda: server.attempts(key) == 1, timeout=10, what="first call running")
        held = call(envoy, key)
    assert held.code == grpc.StatusCode.OK and held.message == first.result.message
    assert held.initial[REPLAYED] == "true" and held.trailing["x-trailer"] == "done-1"
    assert server.executions(key) == 1


def test_a_required_scope_is_unauthenticated_and_streaming_calls_pass(procs, server) -> None:
    config = plugin_config(match={"grpc_services": ["shop.v1.Orders"]}, scope_required=True)
    envoy = start_envoy(procs, server, config)
    anonymous = call(envoy, new_key())
    assert anonymous.code == grpc.StatusCode.UNAUTHENTICATED and problem_of(anonymous) == "missing-scope"
    with channel(envoy) as ch:
        upload = ch.stream_unary("/shop.v1.Orders/Upload")
        reply = upload(iter([b"aa", b"bbb", b"c"]), timeout=10, metadata=[("authorization", "Bearer a")])
        # Without a caller too: only a unary call is refused for its metadata.
        bare = upload(iter([b"dd", b"e"]), timeout=10)
    assert (reply, bare) == (b"uploaded:6", b"uploaded:3")
    assert rule_counter(envoy, "orders", "grpc_streaming") == 2


WASM_ONLY = pytest.mark.skipif(harness.FILTER_BUILD == "native",
                               reason="the Wasm build's replay echo: the native build sends no hop")
NATIVE_ONLY = pytest.mark.skipif(harness.FILTER_BUILD != "native", reason="the native build's own replay")


@WASM_ONLY
def test_a_hop_without_the_echo_route_executes_nothing(procs, server) -> None:
    """A configuration that lost the route to the echo: the replay is UNAVAILABLE, the service
    never sees the hop, and the first call's record is still there."""
    def drop_echo_route(config: dict) -> None:
        for vhost in harness._walk_dicts(config):
            routes = vhost.get("routes")
            if isinstance(routes, list):
                vhost["routes"] = [r for r in routes if r.get("route", {}).get("cluster") != "idempotency_replay_echo"]
                for r in vhost["routes"]:
                    if r.get("match", {}).get("prefix") == "/shop.v1.Orders/":
                        r["match"] = {"prefix": "/"}
    envoy = start_envoy(procs, server, mutate=drop_echo_route)
    key = new_key()
    with channel(envoy) as ch:  # one connection: one worker, one log window
        assert call(ch, key).code == grpc.StatusCode.OK
        retry = call(ch, key)
        assert retry.code == grpc.StatusCode.UNAVAILABLE and problem_of(retry) == "idempotency-unavailable"
        # The record is still there: the next retry is not run either.
        assert call(ch, key).code == grpc.StatusCode.UNAVAILABLE
    assert (server.attempts(key), server.executions(key)) == (1, 1)
    # On-call sees it in a counter, and in one error line per burst naming the missing route.
    assert rule_counter(envoy, "orders", "replay_echo_unrouted") == 2
    unrouted = [line for line in envoy.process.log_text().splitlines()
                if "not answered by the replay echo" in line]
    assert len(unrouted) == 1 and "/idempotency.filter.v1.Replay/" in unrouted[0], unrouted


@WASM_ONLY
def test_an_echo_sharing_the_filters_vm_id_is_refused_at_start(procs, server) -> None:
    """The echo's vm_config given the filter's vm_id: both would run in one VM and share its
    table. Envoy refuses the configuration, and the log says what to change."""
    def echo_on_the_filters_vm(config: dict) -> None:
        for vm in harness._walk_dicts(config):
            if vm.get("vm_id") == "idempotency_replay_echo":
                vm["vm_id"] = "idempotency"
    envoy = grpc_envoy(procs, server, mutate=echo_on_the_filters_vm)
    code, log = envoy.start_expecting_failure(timeout=30)
    assert code == 1, log[-2000:]
    assert "vm_config.vm_id" in log and "give the echo's vm_config a vm_id of its own" in log
    assert "starting main dispatch loop" not in log
    assert not crash_lines(log), crash_lines(log)


def docs_configuration(heading: str) -> dict:
    """The first YAML block under ``heading`` in docs/grpc.md."""
    text = (harness.REPO_ROOT / "docs" / "grpc.md").read_text()
    section = text.split(f"## {heading}", 1)[1]
    return yaml.safe_load(section.split("```yaml", 1)[1].split("```", 1)[0])


def the_docs_configuration_protects_and_replays(envoy: harness.Envoy, server) -> None:
    """A call runs once and its retry gets its message, metadata and trailers back."""
    envoy.start()
    key = new_key()
    first, retry = call(envoy, key), call(envoy, key)
    assert first.code == retry.code == grpc.StatusCode.OK
    assert retry.message == first.message == b"placed:order:1"
    assert retry.initial[REPLAYED] == "true" and retry.trailing["x-trailer"] == "done-1"
    assert server.executions(key) == 1
    assert crash_lines(envoy.process.log_text()) == []


def test_the_minimal_configuration_in_the_docs_protects_and_replays(procs, server) -> None:
    """docs/grpc.md's Envoy configuration, as written there (ports and module path swapped):
    the retry is replayed with its message, through the echo."""
    config = docs_configuration("The Envoy configuration")
    the_docs_configuration_protects_and_replays(procs.add(harness.Envoy(
        config, procs.tmpdir, cluster_ports={"orders": server.port}, wasm_path=wasm_path(),
        name="envoy-docs")), server)


@NATIVE_ONLY
def test_native_a_configuration_that_keeps_the_echo_loads_says_so_once_and_replays_without_it(
        procs, server) -> None:
    """envoy-grpc.yaml whole, the echo included, on the native build: the same JSON loads for
    both filters, the log says once that the native filter does not use the echo, and the
    replay (message, metadata, trailers) never reaches the echo's listener."""
    envoy = start_envoy(procs, server, keep_echo=True)
    key = new_key()
    first, retry = call(envoy, key), call(envoy, key)
    assert recorded_copy(retry) == recorded_copy(first)
    assert retry.initial[REPLAYED] == "true" and retry.trailing["x-trailer"] == "done-1"
    assert server.executions(key) == 1
    echo_requests = envoy.stats(r"^http\.idempotency_replay_echo\.downstream_rq_total$")
    assert echo_requests == {"http.idempotency_replay_echo.downstream_rq_total": 0}, echo_requests
    said = [line for line in envoy.log_text().splitlines()
            if "grpc_replay_echo: the native build's filter replays gRPC answers itself" in line]
    assert len(said) == 1, said


@NATIVE_ONLY
def test_the_native_configuration_in_the_docs_protects_and_replays(procs, server) -> None:
    """docs/grpc.md's native configuration, as written there (ports swapped): no echo, no
    internal listener, and the retry still gets its message and trailers back."""
    config = docs_configuration("The native build's Envoy configuration")
    the_docs_configuration_protects_and_replays(procs.add(harness.Envoy(
        config, procs.tmpdir, cluster_ports={"orders": server.port}, name="envoy-docs-native",
        build="native")), server)


# --------------------------------------------------------------------------
# a hostile client (both builds)
# --------------------------------------------------------------------------


def test_large_trailers_are_replayed_whole_and_too_large_ones_never_run_twice(edge, server) -> None:
    """6 KiB of trailing metadata (within grpcio's 8 KiB) comes back whole on the replay;
    trailers over Envoy's header limit (60 KiB) end the first call's stream without a status:
    its outcome is unknown, and the retry is FAILED_PRECONDITION, not run again."""
    key = new_key()
    md = [("x-test-trailer-bytes", str(6 * 1024))]
    first, retry = call(edge, key, metadata=md), call(edge, key, metadata=md)
    assert first.code == retry.code == grpc.StatusCode.OK
    assert retry.trailing["x-big"] == first.trailing["x-big"] == "b" * 6 * 1024
    assert retry.initial[REPLAYED] == "true" and server.executions(key) == 1

    key = new_key()
    md = [("x-test-trailer-bytes", str(100 * 1024))]
    assert call(edge, key, metadata=md).code != grpc.StatusCode.OK
    retry = call(edge, key, metadata=md)
    assert retry.code == grpc.StatusCode.FAILED_PRECONDITION and problem_of(retry) == "outcome-unknown"
    assert server.executions(key) == 1


def test_a_server_streaming_call_is_replayed_with_every_message(procs, server) -> None:
    """Track answers three messages to one request (it looks unary to the filter): the retry
    gets the three back, marked, with the status."""
    envoy = start_envoy(procs, server, plugin_config(match={"grpc_services": ["shop.v1.Orders"]}))
    key = new_key()
    with channel(envoy) as ch:
        track = ch.unary_stream("/shop.v1.Orders/Track")
        first = list(track(b"order-1", metadata=[("idempotency-key", key)], timeout=10))
        replay = track(b"order-1", metadata=[("idempotency-key", key)], timeout=10)
        again = list(replay)
        assert dict(replay.initial_metadata())[REPLAYED] == "true"
        assert replay.code() == grpc.StatusCode.OK
    assert first == again == [b"update-0", b"update-1", b"update-2"]
    assert rule_counter(envoy, "orders", "replayed") == 1


KEY_ON_STREAM = "grpc-key-on-stream"
STREAMS_TOO = {"grpc_services": ["shop.v1.Orders"]}


def refusal(call_it) -> grpc.RpcError:
    """The error `call_it` raises: the call must fail."""
    with pytest.raises(grpc.RpcError) as raised:
        call_it()
    return raised.value


def assert_refused_as_a_keyed_stream(error: grpc.RpcError) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert "several request messages" in error.details(), error.details()
    assert "Send the key on unary and server-streaming calls only" in error.details()
    assert dict(error.trailing_metadata())[PROBLEM].endswith(":" + KEY_ON_STREAM)


def test_a_stream_sent_to_a_unary_method_under_a_recorded_key_is_refused_not_run_again(edge, server) -> None:
    """Two messages to the unary method under a recorded key (a hostile client: gRPC libraries
    send one). grpcio's server would run the method on the first, so the filter refuses the
    call with INVALID_ARGUMENT before any of it reaches the service; the record stays, and the
    retry of the unary call is still replayed. With a key not yet used, nothing runs either."""
    key = new_key()
    assert call(edge, key).code == grpc.StatusCode.OK
    with channel(edge) as ch:
        placed = ch.stream_unary(PLACE_ORDER)
        error = refusal(lambda: placed(iter([b"order", b"order"]), metadata=[("idempotency-key", key)], timeout=10))
        fresh = new_key()
        unused = refusal(lambda: placed(iter([b"order", b"order"]), metadata=[("idempotency-key", fresh)], timeout=10))
    assert_refused_as_a_keyed_stream(error)
    assert_refused_as_a_keyed_stream(unused)
    assert (server.attempts(key), server.executions(key), server.attempts(fresh)) == (1, 1, 0)
    retry = call(edge, key)
    assert retry.code == grpc.StatusCode.OK and retry.initial[REPLAYED] == "true"
    assert server.executions(key) == 1
    counters = rule_counters(edge, "orders")
    assert (counters["grpc_stream_with_key"], counters["grpc_streaming"], counters["executed"]) == (2, 0, 1)


def test_a_client_stream_streams_through_without_a_key_and_is_refused_with_one(procs, server) -> None:
    envoy = start_envoy(procs, server, plugin_config(match=STREAMS_TOO))
    with channel(envoy) as ch:
        upload = ch.stream_unary("/shop.v1.Orders/Upload")
        assert upload(iter([b"aa", b"bbb", b"c"]), timeout=10) == b"uploaded:6"
        error = refusal(lambda: upload(iter([b"aa", b"bbb"]), metadata=[("idempotency-key", new_key())], timeout=10))
    assert_refused_as_a_keyed_stream(error)
    counters = rule_counters(envoy, "orders")
    assert (counters["grpc_streaming"], counters["grpc_stream_with_key"]) == (1, 1)


def test_a_key_with_an_empty_first_message_or_with_no_message_never_runs_a_recorded_call_again(edge, server) -> None:
    """Attacks on the count of messages: an empty first message then a second is two (refused);
    no message at all passes as a stream, and grpcio's server runs no unary method without its
    one message."""
    key = new_key()
    assert call(edge, key).code == grpc.StatusCode.OK
    md = [("idempotency-key", key)]
    with channel(edge) as ch:
        placed = ch.stream_unary(PLACE_ORDER)
        assert_refused_as_a_keyed_stream(refusal(lambda: placed(iter([b"", b"order"]), metadata=md, timeout=10)))
        nothing = refusal(lambda: placed(iter([]), metadata=md, timeout=10))
    assert nothing.code() != grpc.StatusCode.OK
    assert (server.attempts(key), server.executions(key)) == (1, 1)
    assert rule_counter(edge, "orders", "grpc_streaming") == 1


def test_a_keyed_call_too_large_to_read_is_refused_under_an_optional_key(procs, server) -> None:
    """An optional key lets a call without one pass, but a call that sends the key asked for
    protection: over max_request_bytes it is refused, not run again under its recorded key."""
    envoy = start_envoy(procs, server, plugin_config(key={"required": False}, max_request_bytes=64))
    key = new_key()
    assert call(envoy, key).code == grpc.StatusCode.OK
    large = call(envoy, key, b"x" * 256)
    assert large.code == grpc.StatusCode.RESOURCE_EXHAUSTED and problem_of(large) == "body-too-large"
    assert server.executions(key) == 1
    assert call(envoy, None, b"x" * 256).code == grpc.StatusCode.OK


def held_open(first: bytes, release: threading.Event):
    """A request stream that sends `first`, then waits for `release` before it ends."""
    yield first
    release.wait(timeout=30)


def test_a_keyed_call_cancelled_after_its_first_message_claims_nothing(edge, server) -> None:
    """The client resets after one message (its side still open): held by the filter, so none
    of it reached the service and the key was never claimed; the unary call then runs once."""
    key = new_key()
    release = threading.Event()
    with channel(edge) as ch:
        pending = ch.stream_unary(PLACE_ORDER).future(held_open(b"order", release),
                                                      metadata=[("idempotency-key", key)], timeout=10)
        time.sleep(0.5)
        assert not pending.done()
        pending.cancel()
        release.set()
    assert server.attempts(key) == 0
    first = call(edge, key)
    assert first.code == grpc.StatusCode.OK and REPLAYED not in first.initial
    assert server.executions(key) == 1


def test_a_keyed_bidirectional_call_waiting_for_an_answer_is_held_and_runs_nothing(procs, server) -> None:
    """A bidirectional call with a key that waits for an answer before its second message: it
    looks unary so far, so it is held until its deadline; nothing of it ran. Without a key and
    under an optional key it talks at once."""
    envoy = start_envoy(procs, server, plugin_config(match=STREAMS_TOO, key={"required": False}))
    key = new_key()
    release = threading.Event()
    with channel(envoy) as ch:
        chat = ch.stream_stream("/shop.v1.Orders/Chat")
        answers = chat(held_open(b"hello", release), metadata=[("idempotency-key", key)], timeout=2)
        error = refusal(lambda: next(answers))
        release.set()
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
        talking = threading.Event()
        answers = chat(held_open(b"hello", talking), timeout=10)
        assert next(answers) == b"heard:hello"
        talking.set()
        assert list(answers) == []
    assert server.attempts(key) == 0
    assert rule_counter(envoy, "orders", "passed_through") == 1


# --------------------------------------------------------------------------
# a gRPC service behind an HTTP rule (matched by path prefix)
# --------------------------------------------------------------------------


def http_rule(**fields) -> dict:
    """The rule a new user writes for a gRPC service: an HTTP rule on the service's path."""
    return {"rules": [{"name": "payments", "match": {"path_prefixes": ["/shop.v1.Orders/"]}, **fields}]}


def test_an_http_rule_protects_the_grpc_calls_it_matches_as_grpc(procs, server) -> None:
    envoy = start_envoy(procs, server, http_rule())
    key = new_key()
    first = call(envoy, key)
    retry = call(envoy, key)
    # A successful call's retry is that success, not UNKNOWN carrying the recorded frame.
    assert first.code == retry.code == grpc.StatusCode.OK
    assert retry.message == first.message == b"placed:order:1"
    assert retry.initial[REPLAYED] == "true" and retry.trailing["x-trailer"] == "done-1"
    assert server.executions(key) == 1

    # UNAVAILABLE (HTTP 200, the status in the trailers) is released, not replayed.
    key = new_key()
    md = [("x-test-unavailable-first", "1")]
    assert call(envoy, key, metadata=md).code == grpc.StatusCode.UNAVAILABLE
    second = call(envoy, key, metadata=md)
    assert second.code == grpc.StatusCode.OK and REPLAYED not in second.initial
    assert (server.attempts(key), server.executions(key)) == (2, 1)

    # The filter's own answers are gRPC statuses, not a 409 or a 400.
    the_filters_answers_are_grpc_statuses(envoy, server)
    assert rule_counter(envoy, "payments", "grpc_on_http_rule") == 0


def test_grpc_calls_an_http_rule_cannot_protect_pass_counted_and_warned_once(procs, server) -> None:
    """An HTTP rule reading its key from a JSON body: a gRPC call has none. Its calls run
    unprotected, as they would without the filter, never answered as HTTP."""
    envoy = start_envoy(procs, server, http_rule(key={"sources": [{"json": "/id"}]}))
    key = new_key()
    with channel(envoy) as ch:  # one connection: one worker, whose warning comes once
        answers = [call(ch, key) for _ in range(3)]
    assert [a.code for a in answers] == [grpc.StatusCode.OK] * 3
    assert [a.message for a in answers] == [b"placed:order:1", b"placed:order:2", b"placed:order:3"]
    assert rule_counter(envoy, "payments", "grpc_on_http_rule") == 3
    assert rule_counter(envoy, "payments", "executed") == 0
    warnings = [line for line in envoy.process.log_text().splitlines() if "grpc_on_http_rule" in line]
    assert len(warnings) == 1 and "rule payments" in warnings[0] and "key.sources[0]" in warnings[0], warnings


# --------------------------------------------------------------------------
# cluster mode: two Envoys, one store
# --------------------------------------------------------------------------


def start_replicas(procs):
    """A gRPC server, an embedded store and two Envoys from envoy-grpc.yaml sharing it."""
    server = start_server(procs)
    store = start_backend(procs, "embedded", token=TOKEN)
    envoys = []
    for name in ("envoy-grpc-a", "envoy-grpc-b"):
        plugin = plugin_config()
        with_store_port = with_store(plugin, store.port)

        def mutate(config: dict, with_store_port=with_store_port) -> None:
            with_store_port(config)
            upstream_never_learns_the_deadline(config)

        envoys.append(start_envoy(procs, server, plugin, name=name, mutate=mutate))
    return server, store, envoys


@pytest.fixture(scope="module")
def shared_replicas(tmp_path_factory):
    """One set of replicas for the cluster tests that leave the store running (each uses its
    own keys; counters are reset before each)."""
    group = harness.ProcessGroup(tmp_path_factory.mktemp("grpc-replicas"))
    try:
        yield start_replicas(group)
    finally:
        group.close()


@pytest.fixture
def replicas(shared_replicas):
    server, _, envoys = shared_replicas
    for envoy in envoys:
        envoy.admin("/reset_counters", "POST")
    return server, envoys


def test_cluster_a_call_on_one_replica_is_replayed_on_the_other(replicas) -> None:
    server, (a, b) = replicas
    key = new_key()
    first = call(a, key)
    # A sends its completion to the store after its answer: until it lands, B is told the
    # call is in flight (ABORTED), as a client retrying at once would be.
    retry = answer_once_settled(lambda: call(b, key))
    assert recorded_copy(retry) == recorded_copy(first)
    assert retry.initial[REPLAYED] == "true"
    assert server.executions(key) == 1


# Run alone (`make e2e`, after the parallel pass): with three test files at a time on two
# cores, the first call's end sometimes did not reach the filter 30 s after its client gave
# up (the rule counted only `executed`), a retry meanwhile being told it is in flight. Not
# understood yet; one at a time it has always passed.
@pytest.mark.alone
def test_cluster_a_deadline_on_one_replica_is_not_run_again_on_the_other(replicas) -> None:
    server, (a, b) = replicas
    deadline_then_retry(a, b, server)


def answer_once_settled(send, timeout: float = 10.0):
    """``send()`` again while it answers ABORTED (a call in flight), as a retrying client
    would; the first other answer."""
    deadline = time.monotonic() + timeout
    while True:
        answer = send()
        if answer.code != grpc.StatusCode.ABORTED or time.monotonic() >= deadline:
            return answer
        time.sleep(0.1)


def test_cluster_a_transient_status_on_one_replica_leaves_the_call_retryable_on_the_other(
        replicas) -> None:
    server, (a, b) = replicas
    key = new_key()
    md = [("x-test-unavailable-first", "1")]
    assert call(a, key, metadata=md).code == grpc.StatusCode.UNAVAILABLE
    second = call(b, key, metadata=md)
    assert second.code == grpc.StatusCode.OK
    # B sends its completion to the store after its answer: until it lands, A is told the
    # call is in flight (ABORTED), as a client retrying at once would be.
    third = answer_once_settled(lambda: call(a, key, metadata=md))
    assert third.message == second.message and third.initial[REPLAYED] == "true"
    assert (server.attempts(key), server.executions(key)) == (2, 1)


def test_cluster_a_retry_policy_on_another_replica_waits_out_the_call_in_flight(replicas) -> None:
    server, (a, b) = replicas
    retry_policy_through_a_call_in_flight(a, b, server)


def test_cluster_a_store_that_is_down_is_unavailable_and_runs_nothing(procs) -> None:
    server, store, (a, _) = start_replicas(procs)
    store.stop()
    key = new_key()
    answer = call(a, key)
    assert answer.code == grpc.StatusCode.UNAVAILABLE and problem_of(answer) == "idempotency-unavailable"
    assert answer.trailing["grpc-retry-pushback-ms"] == "1000"
    assert server.attempts(key) == 0


# --------------------------------------------------------------------------


class harness_thread:
    """Runs ``fn`` in a thread for the ``with`` block; ``.result`` once the block is left."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.result = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.result = self.fn()

    def __enter__(self) -> "harness_thread":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(timeout=30)

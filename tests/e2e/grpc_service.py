"""A real gRPC server (grpcio) for the end-to-end tests: the shop's Orders service.

Messages are raw bytes (no protobuf schema needed: the filter treats them as opaque), so
the handlers are generic. Each call's behaviour is chosen by its metadata, so one server
serves every test:

- ``x-test-sleep-ms``: sleep this long after counting the execution, before answering;
- ``x-test-status``: answer with this status code (a number) instead of OK, with trailing
  metadata and ``grpc-status-details-bin``;
- ``x-test-trailer-bytes``: add a trailer ``x-big`` of this many bytes;
- ``x-test-unavailable-first``: the first call with this key answers UNAVAILABLE without
  executing (a transient failure); later ones execute.

``/shop.v1.Orders/PlaceOrder`` is the unary write, ``/shop.v1.Orders/Lookup`` answers what a
PlaceOrder with the call's idempotency key placed once it finished (NOT_FOUND before); ``/shop.v1.Orders/Track`` streams
three answers to one request; ``/shop.v1.Orders/Upload`` takes a stream of messages;
``/shop.v1.Orders/Chat`` (bidirectional) answers each message as it comes, each one counted as
an execution of the call's key.
``/test.v1.Control/Executions`` (called directly, not through Envoy) answers how many
times each idempotency key was executed, as JSON.

Run: ``python grpc_service.py --port N``; it prints ``ready`` once serving.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent import futures

import grpc

_lock = threading.Lock()
_executions: dict[str, int] = {}
_attempts: dict[str, int] = {}
_placed: dict[str, bytes] = {}
_lookups: dict[str, int] = {}


def _metadata(context: grpc.ServicerContext) -> dict[str, str | bytes]:
    return {k: v for k, v in context.invocation_metadata()}


def place_order(request: bytes, context: grpc.ServicerContext) -> bytes:
    md = _metadata(context)
    key = str(md.get("idempotency-key", ""))
    with _lock:
        _attempts[key] = _attempts.get(key, 0) + 1
        first = _attempts[key] == 1
    if md.get("x-test-unavailable-first") and first:
        context.abort(grpc.StatusCode.UNAVAILABLE, "warming up, not executed")
    with _lock:
        _executions[key] = _executions.get(key, 0) + 1
        n = _executions[key]
    sleep_ms = int(str(md.get("x-test-sleep-ms", "0")))
    if sleep_ms:
        time.sleep(sleep_ms / 1000)
    answer = b"placed:" + request + b":" + str(n).encode()
    if not md.get("x-test-status"):
        # The order is placed now, whether or not the caller is still there to hear of it.
        with _lock:
            _placed[key] = answer
    context.send_initial_metadata((("x-order-id", f"order-{key}-{n}"),))
    status = md.get("x-test-status")
    if status:
        code = next(c for c in grpc.StatusCode if c.value[0] == int(str(status)))
        context.set_trailing_metadata((
            ("x-trailer", f"failed-{n}"),
            ("grpc-status-details-bin", b"\x08\x09\x12\x04nope" + bytes([n])),
        ))
        context.abort(code, f"refused on execution {n}")
    big = int(str(md.get("x-test-trailer-bytes", "0")))
    context.set_trailing_metadata((("x-trailer", f"done-{n}"), ("x-bin-bin", bytes([0, 1, 2, n])))
                                  + ((("x-big", "b" * big),) if big else ()))
    return answer


def lookup(request: bytes, context: grpc.ServicerContext) -> bytes:
    """The order a PlaceOrder with this idempotency key placed, once it finished; NOT_FOUND
    before that (or if none ran)."""
    key = str(_metadata(context).get("idempotency-key", ""))
    with _lock:
        _lookups[key] = _lookups.get(key, 0) + 1
        placed = _placed.get(key)
    # The key echoed back: the filter takes a NOT_FOUND for "never ran" only from the method
    # that looked the key up, not from a proxy on the way.
    if placed is None:
        context.set_trailing_metadata((("idempotency-key", key),))
        context.abort(grpc.StatusCode.NOT_FOUND, "no order placed with this key")
    return placed


def track(request: bytes, context: grpc.ServicerContext):
    for i in range(3):
        yield b"update-%d" % i


def upload(request_iterator, context: grpc.ServicerContext) -> bytes:
    total = sum(len(m) for m in request_iterator)
    return b"uploaded:%d" % total


def chat(request_iterator, context: grpc.ServicerContext):
    key = str(_metadata(context).get("idempotency-key", ""))
    for message in request_iterator:
        with _lock:
            _attempts[key] = _attempts.get(key, 0) + 1
            _executions[key] = _executions.get(key, 0) + 1
        yield b"heard:" + message


def executions(request: bytes, context: grpc.ServicerContext) -> bytes:
    with _lock:
        return json.dumps({"executions": _executions, "attempts": _attempts,
                           "lookups": _lookups}).encode()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    server.add_generic_rpc_handlers((
        grpc.method_handlers_generic_handler("shop.v1.Orders", {
            "PlaceOrder": grpc.unary_unary_rpc_method_handler(place_order),
            "Lookup": grpc.unary_unary_rpc_method_handler(lookup),
            "Track": grpc.unary_stream_rpc_method_handler(track),
            "Upload": grpc.stream_unary_rpc_method_handler(upload),
            "Chat": grpc.stream_stream_rpc_method_handler(chat),
        }),
        grpc.method_handlers_generic_handler("test.v1.Control", {
            "Executions": grpc.unary_unary_rpc_method_handler(executions),
        }),
    ))
    server.add_insecure_port(f"127.0.0.1:{args.port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    sys.exit(main())

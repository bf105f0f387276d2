"""An HTTP/2 upstream that refuses streams, for the end-to-end tests: the server an HTTP/2
service is when it is above its stream limit or going away in a rolling restart.

Built on the ``h2`` protocol library (cleartext HTTP/2, prior knowledge, as Envoy's
``http2_protocol_options`` speaks it). The first stream carrying an ``idempotency-key`` is
refused unprocessed, by how the request header ``x-test-refuse`` says:

- ``rst`` (the default): ``RST_STREAM(REFUSED_STREAM)`` as soon as its headers arrive;
- ``goaway``: ``GOAWAY`` whose last stream id is below this stream's (RFC 9113 6.8: a stream
  above it was not processed), then the connection closes.

Every later stream with that key is executed: counted, and answered ``201`` with a JSON body,
or, for a gRPC call (``content-type: application/grpc``), one message and ``grpc-status: 0``.
A GET to ``/counts`` on the control port (HTTP/1.1) answers what the server saw, as JSON:
``{"refused": {key: n}, "executions": {key: n}}``.

Run: ``python refusing_h2_server.py --port N --control-port M``; it prints ``ready``.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import ConnectionTerminated, DataReceived, RequestReceived, StreamEnded, StreamReset

_lock = threading.Lock()
_refused: dict[str, int] = {}
_executions: dict[str, int] = {}


def _count(table: dict[str, int], key: str) -> int:
    with _lock:
        table[key] = table.get(key, 0) + 1
        return table[key]


def _first_sight(key: str) -> bool:
    """Whether no stream with ``key`` came before (the one to refuse)."""
    with _lock:
        return key not in _refused and key not in _executions


def _grpc_frame(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


class _Connection:
    """One downstream connection (Envoy's), served on its own thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.h2 = H2Connection(H2Configuration(client_side=False, header_encoding="utf-8"))
        self.requests: dict[int, dict[str, str]] = {}
        self.closing = False

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.sock.sendall(data)

    def serve(self) -> None:
        self.h2.initiate_connection()
        self.flush()
        while not self.closing:
            data = self.sock.recv(65536)
            if not data:
                break
            for event in self.h2.receive_data(data):
                self.handle(event)
            self.flush()
        self.sock.close()

    def handle(self, event: object) -> None:
        if isinstance(event, RequestReceived):
            headers = dict(event.headers)
            key = headers.get("idempotency-key", "")
            if key and _first_sight(key):
                _count(_refused, key)
                self.refuse(event.stream_id, headers.get("x-test-refuse", "rst"))
                return
            self.requests[event.stream_id] = headers
            if event.stream_ended:
                self.execute(event.stream_id)
        elif isinstance(event, DataReceived):
            self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, StreamEnded) and event.stream_id in self.requests:
            self.execute(event.stream_id)
        elif isinstance(event, StreamReset):
            self.requests.pop(event.stream_id, None)
        elif isinstance(event, ConnectionTerminated):
            self.closing = True

    def refuse(self, stream_id: int, how: str) -> None:
        if how == "goaway":
            self.h2.close_connection(error_code=ErrorCodes.NO_ERROR, last_stream_id=max(stream_id - 2, 0))
            self.flush()
            self.closing = True
        else:
            self.h2.reset_stream(stream_id, error_code=ErrorCodes.REFUSED_STREAM)

    def execute(self, stream_id: int) -> None:
        headers = self.requests.pop(stream_id)
        key = headers.get("idempotency-key", "")
        n = _count(_executions, key)
        if headers.get("content-type", "").startswith("application/grpc"):
            self.h2.send_headers(stream_id, [(":status", "200"), ("content-type", "application/grpc")])
            self.h2.send_data(stream_id, _grpc_frame(b"placed:%d" % n))
            self.h2.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)
            return
        body = json.dumps({"id": f"{key}-{n}", "execution": n}).encode()
        self.h2.send_headers(stream_id, [
            (":status", "201"),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
            ("x-execution", str(n)),
        ])
        self.h2.send_data(stream_id, body, end_stream=True)


def _serve_connection(sock: socket.socket) -> None:
    try:
        _Connection(sock).serve()
    except (OSError, ValueError) as e:
        # A connection Envoy dropped; the server goes on with the others.
        print(f"connection ended: {e}", file=sys.stderr, flush=True)


class _Control(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        with _lock:
            body = json.dumps({"refused": _refused, "executions": _executions}).encode()
        self.send_response(200 if self.path == "/counts" else 404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--control-port", type=int, required=True)
    args = parser.parse_args()
    control = ThreadingHTTPServer(("127.0.0.1", args.control_port), _Control)
    threading.Thread(target=control.serve_forever, daemon=True).start()
    listener = socket.create_server(("127.0.0.1", args.port))
    print("ready", flush=True)
    while True:
        sock, _ = listener.accept()
        threading.Thread(target=_serve_connection, args=(sock,), daemon=True).start()


if __name__ == "__main__":
    main()

"""A peer that reaches the store's port cannot hold its connections against the Envoys.

The store takes a connection before it knows who calls, ``/healthz`` needs no token, and an
idle HTTP/2 connection used to live ``--idle-timeout-secs`` (300 s). A peer that opened as
many as ``--max-connections`` and kept them (answering the store's PINGs) made every Envoy
that connected afterwards (a restart, a new pod) wait in the listen backlog: its claims timed
out, and under ``fail_closed`` every protected write got 503. Now connections that have not
shown the token get a share of the slots and a few seconds each, and a newcomer pushes out
the oldest of them; the restarted Envoy and a new one claim, execute once and replay.
"""

from __future__ import annotations

import random
import selectors
import socket
import struct
import threading
import time

import harness
from cluster import Cluster, cluster_plugin_config, post, start_backend, wait_for_answer
from helpers import is_replay, new_key, rule_counters, unique_path

STORE_TIMEOUT_MS = 2000
MAX_CONNECTIONS = 64

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADERS, FRAME_SETTINGS, FRAME_PING = 1, 4, 6
FLAG_ACK = 0x1


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _get_healthz() -> bytes:
    # HPACK: indexed :method GET and :scheme http, literal :path and :authority.
    block = bytes([0x82, 0x86, 0x04, 8]) + b"/healthz" + bytes([0x01, 5]) + b"store"
    return _frame(FRAME_HEADERS, 0x05, 1, block)  # END_STREAM | END_HEADERS


class ConnectionHolder:
    """The hostile peer: keeps ``target`` HTTP/2 connections to the store open from several
    loopback addresses, each asking ``GET /healthz`` once and then idling like a well-behaved
    client (SETTINGS and PINGs acknowledged, so keepalive never drops it); whenever the store
    closes one it opens another, ten times a second."""

    SOURCES = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]

    def __init__(self, port: int, target: int) -> None:
        self.port, self.target = port, target
        self.selector = selectors.DefaultSelector()
        self.buffers: dict[socket.socket, bytes] = {}
        self.opened = 0
        self.closed_by_store = 0
        self.most_held = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="connection-holder", daemon=True)

    def __enter__(self) -> "ConnectionHolder":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for sock in list(self.buffers):
            sock.close()

    @property
    def held(self) -> int:
        return len(self.buffers)

    def _open_one(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((random.choice(self.SOURCES), 0))
        sock.settimeout(2)
        try:
            sock.connect((harness.LOOPBACK, self.port))
            sock.sendall(H2_PREFACE + _frame(FRAME_SETTINGS, 0, 0) + _get_healthz())
        except OSError:
            sock.close()
            return
        sock.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ)
        self.buffers[sock] = b""
        self.opened += 1

    def _close(self, sock: socket.socket) -> None:
        self.selector.unregister(sock)
        del self.buffers[sock]
        sock.close()
        self.closed_by_store += 1

    def _answer(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._close(sock)
            return
        buf = self.buffers[sock] + data
        replies = b""
        while len(buf) >= 9:
            length = int.from_bytes(buf[:3], "big")
            if len(buf) < 9 + length:
                break
            kind, flags, payload = buf[3], buf[4], buf[9:9 + length]
            if kind == FRAME_SETTINGS and not flags & FLAG_ACK:
                replies += _frame(FRAME_SETTINGS, FLAG_ACK, 0)
            elif kind == FRAME_PING and not flags & FLAG_ACK:
                replies += _frame(FRAME_PING, FLAG_ACK, 0, payload)
            buf = buf[9 + length:]
        self.buffers[sock] = buf
        if replies:
            try:
                sock.sendall(replies)
            except OSError:
                self._close(sock)

    def _run(self) -> None:
        next_fill = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_fill:
                while self.held < self.target and not self._stop.is_set():
                    self._open_one()
                self.most_held = max(self.most_held, self.held)
                next_fill = time.monotonic() + 0.1
            for key, _ in self.selector.select(timeout=0.05):
                if key.fileobj in self.buffers:
                    self._answer(key.fileobj)  # type: ignore[arg-type]


def test_a_peer_holding_store_connections_cannot_keep_a_restarted_envoy_from_claiming(procs) -> None:
    plugin = cluster_plugin_config(timeout_ms=STORE_TIMEOUT_MS)
    store = start_backend(procs, "embedded", extra_args=["--max-connections", str(MAX_CONNECTIONS)])
    cluster = Cluster(procs=procs, upstream=procs.upstream(), store=store, envoys=[])
    envoy = cluster.add_envoy("envoy-a", plugin)
    warm = post(envoy, unique_path(), new_key())
    assert warm.status_code == 201, warm.content[:300]

    # Twice as many connections as the store serves, held from before the restart on.
    with ConnectionHolder(store.port, target=2 * MAX_CONNECTIONS) as holder:
        harness.wait_until(lambda: holder.opened >= 2 * MAX_CONNECTIONS, timeout=20,
                           what="the peer to open its connections")
        time.sleep(1)
        envoy.restart()
        newcomer = cluster.add_envoy("envoy-b", plugin)

        path, key = unique_path(), new_key()
        first = post(envoy, path, key)
        assert first.status_code == 201 and not is_replay(first), (first.status_code, first.content[:300])
        # The first write's completion reaches the store after its response: until then the
        # newcomer is told the write is in flight (409), as a client retrying at once would be.
        retry, _ = wait_for_answer(lambda: post(newcomer, path, key), timeout=10,
                                   what="the first write's completion to reach the store")
        assert (retry.status_code, is_replay(retry)) == (201, True), (retry.status_code, retry.content[:300])
        assert retry.content == first.content
        assert cluster.upstream.executions(path) == 1
        for e in (envoy, newcomer):
            counters = rule_counters(e, "orders")
            assert counters["store_error"] == 0, (e.name, counters)
        print(f"the peer opened {holder.opened} connections, held at most {holder.most_held}, "
              f"and the store closed {holder.closed_by_store}")
        # The peer kept trying all along, and the store kept pushing it out.
        assert holder.held > 0 and holder.closed_by_store > MAX_CONNECTIONS, vars(holder)

    # The Envoys' streams are the authenticated connections; the peer's were closed before
    # they ever showed a token (pushed out for newer ones, or out of time).
    assert store.metric("idempotency_store_connections", state="authenticated") >= 2
    pushed_out = sum(store.metric("idempotency_store_unauthenticated_connections_closed_total",
                                  reason=why) for why in ("evicted", "peer_limit", "timeout"))
    assert pushed_out >= MAX_CONNECTIONS, pushed_out

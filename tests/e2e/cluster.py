"""The cluster harness: a demo upstream, one idempotency store (embedded or on Redis) and
Envoys built from envoy/envoy.yaml that share it, a store that misbehaves on purpose, and
the cluster tests' requests (every one with the same Host, as behind a load balancer).

Everything runs on 127.0.0.1; processes are stopped by their own PID (through the harness).
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import client
import harness
from helpers import (
    REPLAYED,
    STORE_CLUSTER,
    TIMEOUT,
    envoy_yaml_plugin_config,
    problem,
    rule_counter,
    send,
    start_envoy,
)

DEMO_TOKEN = "demo-token-change-me"
# The Host both Envoys get: ":authority" is part of the default key scope, so the same logical
# request must carry the same Host on every replica (as it does behind a load balancer).
HOST = "api.test"
BODY = b'{"sku":"book","qty":1}'


# --------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------


def cluster_plugin_config(
    *,
    timeout_ms: int | None = None,
    token: str | None = None,
    transport: str | None = None,
    extra_rules: Iterable[dict] = (),
    **orders: Any,
) -> dict:
    """envoy/envoy.yaml's plugin configuration with the global store's ``timeout_ms`` /
    ``token`` / ``transport`` changed, fields of the ``orders`` rule overridden, and rules
    appended."""
    config = envoy_yaml_plugin_config()
    if timeout_ms is not None:
        config["store"]["timeout_ms"] = timeout_ms
    if token is not None:
        config["store"]["token"] = token
    if transport is not None:
        config["store"]["transport"] = transport
    for rule in config["rules"]:
        if rule["name"] == "orders":
            rule.update(orders)
    config["rules"].extend(copy.deepcopy(list(extra_rules)))
    return config


def store_over_http1(config: dict) -> None:
    """``mutate`` for Envoy: talk HTTP/1.1 to the store cluster (for a fake store that
    cannot speak h2c)."""
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == STORE_CLUSTER:
            cluster.pop("typed_extension_protocol_options", None)


# --------------------------------------------------------------------------
# the cluster
# --------------------------------------------------------------------------


def start_backend(procs: harness.ProcessGroup, backend: str, **kwargs: Any) -> harness.Store:
    """A store with ``backend`` and envoy.yaml's token; for redis, also a redis-server (AOF
    on, so it can restart)."""
    redis = procs.redis(appendonly=True) if backend == "redis" else None
    kwargs.setdefault("token", DEMO_TOKEN)
    return procs.store(backend=backend, redis=redis, **kwargs)


@dataclass
class Cluster:
    """A demo upstream, one store, and Envoys from envoy/envoy.yaml sharing that store."""

    procs: harness.ProcessGroup
    upstream: harness.Upstream
    store: harness.Store
    envoys: list[harness.Envoy]

    @property
    def redis(self) -> harness.Redis | None:
        return self.store.redis

    @property
    def a(self) -> harness.Envoy:
        return self.envoys[0]

    @property
    def b(self) -> harness.Envoy:
        return self.envoys[1]

    def add_envoy(self, name: str, plugin: dict | None = None, mutate: Any = None) -> harness.Envoy:
        """An Envoy from envoy/envoy.yaml (concurrency 2) with only ports, module path and,
        if given, the plugin configuration changed."""
        envoy = start_envoy(self.procs, self.upstream, plugin, store_port=self.store.port,
                            name=name, mutate=mutate, concurrency=2)
        self.envoys.append(envoy)
        return envoy

    def store_completions(self) -> float:
        return self.store.metric("idempotency_store_operations_total", operation="complete",
                                 outcome="completed")


def start_cluster(
    procs: harness.ProcessGroup,
    backend: str = "embedded",
    *,
    plugin: dict | None = None,
    envoys: int = 2,
) -> Cluster:
    store = start_backend(procs, backend)
    cluster = Cluster(procs=procs, upstream=procs.upstream(), store=store, envoys=[])
    for i in range(envoys):
        cluster.add_envoy(f"envoy-{'abcdefgh'[i]}", plugin)
    return cluster


# --------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------


def post(
    envoy: harness.Envoy,
    path: str,
    key: str,
    *,
    body: bytes = BODY,
    headers: Mapping[str, str] | None = None,
    timeout: float = TIMEOUT,
) -> client.Response:
    return send(envoy, path, key=key, body=body, headers={"Host": HOST, **(headers or {})}, timeout=timeout)


def raw_post(
    envoy: harness.Envoy,
    path: str,
    key: str,
    *,
    body: bytes = BODY,
    headers: Mapping[str, str] | None = None,
    recv_buffer: int | None = None,
    body_bytes_sent: int | None = None,
) -> client.RawExchange:
    """The request ``post`` sends, on a socket the test holds (to hang up on Envoy); see
    ``client.RawExchange`` for ``recv_buffer`` and ``body_bytes_sent``."""
    all_headers = [("Host", HOST), ("idempotency-key", key), ("content-type", "application/json")]
    all_headers += list((headers or {}).items())
    return client.RawExchange(harness.LOOPBACK, envoy.port, "POST", path, all_headers, body,
                              recv_buffer=recv_buffer, body_bytes_sent=body_bytes_sent)


def assert_unavailable(resp: client.Response, rule: str = "orders") -> dict:
    """The fail_closed answer: 503 problem+json, idempotency-unavailable, Retry-After."""
    doc = problem(resp, 503, "idempotency-unavailable", rule=rule)
    assert resp.headers.get("retry-after") == "1", dict(resp.headers)
    return doc


def past_in_flight(send: Callable[[], client.Response], timeout: float = 10.0,
                   interval: float = 0.1) -> client.Response:
    """Calls ``send()`` while it answers 409 request-in-flight (bounded by ``timeout``): the
    first replica's record is on its way to the store, from its root context after its own
    answer. Returns the first other answer, a 409 of another kind included."""
    deadline = time.monotonic() + timeout
    while True:
        resp = send()
        in_flight = resp.status_code == 409 and b"request-in-flight" in resp.content
        if not in_flight or time.monotonic() >= deadline:
            return resp
        time.sleep(interval)


def wait_for_answer(
    send: Callable[[], client.Response], timeout: float, *, interval: float = 0.1,
    what: str = "an answer other than 409",
) -> tuple[client.Response, list[client.Response]]:
    """Calls ``send()`` until it answers something other than 409 (bounded by ``timeout``);
    returns that answer and the 409s before it."""
    conflicts: list[client.Response] = []
    deadline = time.monotonic() + timeout
    while True:
        resp = send()
        if resp.status_code != 409:
            return resp, conflicts
        conflicts.append(resp)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"still 409 after {timeout}s ({len(conflicts)} tries): {what}")
        time.sleep(interval)


def wasm_vm_failures(envoy: harness.Envoy) -> dict[str, int]:
    """Envoy's wasm VM health stats that must stay 0 (reloads happen only after a VM failed)."""
    stats = envoy.stats(filter=r"^wasm\.")
    return {k: v for k, v in stats.items() if k.startswith("wasm.idempotency.vm_reload") and v}


def complete_while_store_down(envoy: harness.Envoy, cluster: Cluster, path: str, key: str,
                              *, delay_ms: int = 500) -> bytes:
    """Sends a write through ``envoy`` and stops the store while the upstream works on it; the
    client reads the 201 and hangs up (RST), so the completion can only be delivered by the
    root context. Returns when the filter has seen it fail; the whole body read is returned."""
    with raw_post(envoy, path, key, headers={"x-demo-delay-ms": str(delay_ms)}) as raw:
        harness.wait_until(lambda: cluster.upstream.executions(path) == 1, timeout=10,
                           what="the upstream to start executing")
        cluster.store.stop()
        head = raw.read_head(timeout=15)
        assert head.status == 201 and REPLAYED not in head.headers, (head.status, head.headers)
        body = raw.read_body(timeout=15)
        raw.abort()
    harness.wait_until(lambda: rule_counter(envoy, "orders", "store_error") >= 1
                       or completion_failure_logged(envoy), timeout=10,
                       what="the completion to fail against the stopped store")
    return body


def completion_failure_logged(envoy: harness.Envoy) -> bool:
    """Whether ``envoy`` logged a completion failing against the store: from its worker's
    root, or, on the native build, from the main thread's handoff while that worker is idle
    (its root learns of the failure only at its next request)."""
    text = envoy.log_text()
    return ("store Complete failed" in text
            or "store Complete of an idle worker failed on the store thread" in text)


# --------------------------------------------------------------------------
# a fake store that misbehaves
# --------------------------------------------------------------------------

# Runs as its own process (python -c). Answers every POST with the behaviour named in
# MODE_FILE, re-read per request so one process covers every case. HTTP/1.1 only.
_FAKE_STORE = r'''
import http.server, socketserver, sys
port, mode_file = int(sys.argv[1]), sys.argv[2]

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, fmt, *args):
        sys.stdout.write("fake-store %s %s\n" % (self.path, fmt % args)); sys.stdout.flush()
    def answer(self, status, body, ctype="application/json"):
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self.answer(200, b"ok", "text/plain")
    def do_POST(self):
        n = int(self.headers.get("content-length") or 0)
        self.rfile.read(n)
        mode = open(mode_file).read().strip()
        sys.stdout.write("fake-store mode %s\n" % mode); sys.stdout.flush()
        if mode == "malformed_json":
            self.answer(200, b'{"outcome": "claimed", "owner": ')
        elif mode == "status_500":
            self.answer(500, b'{"type":"boom"}', "application/problem+json")
        elif mode == "bad_base64":
            self.answer(200, b'{"outcome":"completed","record":"!!notbase64"}')
        elif mode == "not_a_record":
            self.answer(200, b'{"outcome":"completed","record":"aGVsbG8="}')
        elif mode == "unknown_outcome":
            self.answer(200, b'{"outcome":"exploded"}')
        elif mode == "close":
            self.close_connection = True
            try:
                self.connection.shutdown(2)
            except OSError:
                pass
        else:
            self.answer(599, b"unknown mode")

class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

srv = Server(("127.0.0.1", port), Handler)
print("fake-store listening", flush=True)
srv.serve_forever()
'''


class FakeStore:
    def __init__(self, procs: harness.ProcessGroup, tmp_path: Path) -> None:
        self.port = harness.free_port()
        self.mode_file = Path(tmp_path) / "fake-store-mode"
        self.set_mode("status_500")
        self.process = procs.process(
            [sys.executable, "-c", _FAKE_STORE, str(self.port), str(self.mode_file)], name="fake-store"
        )
        harness.wait_for_http(f"http://{harness.LOOPBACK}:{self.port}/healthz", timeout=15, proc=self.process)

    def set_mode(self, mode: str) -> None:
        self.mode_file.write_text(mode)

    def requests_in_mode(self, mode: str) -> int:
        return self.process.log_text().count(f"fake-store mode {mode}\n")

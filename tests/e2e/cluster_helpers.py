"""Helpers for the cluster-mode end-to-end tests (test_cluster.py): the idempotency store as a
managed process, Envoys built from envoy/envoy.yaml that share it, a misbehaving fake store,
and small request helpers.

Everything runs on 127.0.0.1; processes are stopped by their own PID (through the harness).
"""

from __future__ import annotations

import copy
import re
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import requests
import yaml

import harness
import helpers
from helpers import wasm_path

STORE_CLUSTER = "idempotency_store"
UPSTREAM_CLUSTER = "demo_upstream"
DEMO_TOKEN = "demo-token-change-me"
PROBLEM_UNAVAILABLE = "urn:idempotency-filter:problem:idempotency-unavailable"
PROBLEM_IN_FLIGHT = "urn:idempotency-filter:problem:request-in-flight"
REPLAYED = "idempotent-replayed"
# The Host both Envoys get: ":authority" is part of the default key scope, so the same logical
# request must carry the same Host on every replica (as it does behind a load balancer).
HOST = "api.test"
TIMEOUT = 20.0

# Envoy's own complaints about a VM (not the module's "wasm log ..." lines, which may say
# "store Complete failed" on purpose).
_VM_FAILURE = re.compile(r"failed to .*wasm|wasm.*failed to|wasm vm.*(failed|crash)", re.IGNORECASE)


def crash_lines(text: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if line in helpers.crash_lines(line)
        or ("wasm log " not in line and _VM_FAILURE.search(line))
    ]


# --------------------------------------------------------------------------
# the store
# --------------------------------------------------------------------------

READY_LINE = "idempotency-store listening on"


class Store:
    """One idempotency-store process on a fixed port (kept across restarts)."""

    def __init__(
        self,
        tmpdir: Path,
        *,
        backend: str,
        redis: harness.Redis | None,
        token: str,
        name: str,
        port: int | None = None,
    ) -> None:
        self.backend = backend
        self.redis = redis
        self.port = port or harness.free_port()
        self.base_url = f"http://{harness.LOOPBACK}:{self.port}"
        self.data_dir = Path(tmpdir) / f"{name}-data"
        self.token = token
        token_file = Path(tmpdir) / f"{name}-token"
        token_file.write_text(token + "\n")
        argv: list[Any] = [
            harness.store_binary(),
            "--listen", f"{harness.LOOPBACK}:{self.port}",
            "--backend", backend,
            "--data-dir", self.data_dir,
            "--token-file", token_file,
        ]
        if backend == "redis":
            if redis is None:
                raise ValueError("the redis backend needs a running redis")
            argv += ["--redis-url", f"redis://{harness.LOOPBACK}:{redis.port}/"]
        self.process = harness.ManagedProcess(argv, name=name, log_dir=tmpdir)
        self.paused = False

    def start(self, timeout: float = 20.0) -> "Store":
        before = self.process.log_text().count(READY_LINE)
        self.process.start()
        try:
            harness.wait_until(
                lambda: harness._check_alive(self.process, "the store's ready line")
                or self.process.log_text().count(READY_LINE) > before,
                timeout=timeout,
                what=f"{self.process.name} ready line",
            )
            harness.wait_for_http(self.url("/healthz"), timeout=timeout, proc=self.process)
        except BaseException:
            self.process.stop()
            raise
        return self

    def stop(self) -> int | None:
        self.resume()  # a stopped process would not see SIGTERM until SIGKILL
        return self.process.stop()

    def restart(self, timeout: float = 20.0) -> "Store":
        self.stop()
        return self.start(timeout)

    def pause(self) -> None:
        """SIGSTOP to this store's PID: connections are accepted by the kernel, nothing answers."""
        self.process.signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.paused:
            self.process.signal(signal.SIGCONT)
            self.paused = False

    def url(self, path: str) -> str:
        return self.base_url + path

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {'name{label="v",...}': value} (labels as printed) plus, for every
        labelled sample, the bare name summed over its label sets."""
        resp = requests.get(self.url("/metrics"), timeout=5)
        resp.raise_for_status()
        return parse_metrics(resp.text)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of every sample of ``name`` whose labels include ``labels`` (0 if none)."""
        resp = requests.get(self.url("/metrics"), timeout=5)
        resp.raise_for_status()
        total = 0.0
        for sample_name, sample_labels, value in iter_samples(resp.text):
            if sample_name == name and all(sample_labels.get(k) == v for k, v in labels.items()):
                total += value
        return total

    def log_text(self) -> str:
        return self.process.log_text()


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def iter_samples(text: str):
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        yield m.group(1), labels, value


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, labels, value in iter_samples(text):
        if labels:
            key = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
            out[key] = value
            out[name] = out.get(name, 0.0) + value
        else:
            out[name] = value
    return out


def start_store(
    procs: harness.ProcessGroup,
    tmp_path: Path,
    backend: str = "embedded",
    redis: harness.Redis | None = None,
    token: str = DEMO_TOKEN,
    name: str = "store",
    port: int | None = None,
) -> Store:
    """Starts a store registered with ``procs`` (stopped at teardown)."""
    store = Store(Path(tmp_path), backend=backend, redis=redis, token=token, name=name, port=port)
    procs.add(store)
    return store.start()


def start_backend(procs: harness.ProcessGroup, tmp_path: Path, backend: str, **kwargs: Any) -> Store:
    """A store with ``backend``; for redis, also a redis-server (AOF on, so it can restart)."""
    redis = procs.redis(appendonly=True) if backend == "redis" else None
    return start_store(procs, tmp_path, backend=backend, redis=redis, **kwargs)


# --------------------------------------------------------------------------
# Envoys built from envoy/envoy.yaml
# --------------------------------------------------------------------------


def default_plugin_config() -> dict:
    """The plugin configuration of envoy/envoy.yaml, as users get it."""
    config = yaml.safe_load(harness.default_envoy_config().read_text())
    return harness.get_plugin_configuration(config)


def plugin_config(
    *,
    timeout_ms: int | None = None,
    token: str | None = None,
    extra_rules: Iterable[dict] = (),
    **orders: Any,
) -> dict:
    """envoy/envoy.yaml's plugin configuration with the global store's ``timeout_ms`` /
    ``token`` changed, fields of the ``orders`` rule overridden, and rules appended."""
    config = copy.deepcopy(default_plugin_config())
    if timeout_ms is not None:
        config["store"]["timeout_ms"] = timeout_ms
    if token is not None:
        config["store"]["token"] = token
    for rule in config["rules"]:
        if rule["name"] == "orders":
            rule.update(orders)
    config["rules"].extend(copy.deepcopy(list(extra_rules)))
    return config


def start_envoy(
    procs: harness.ProcessGroup,
    *,
    name: str,
    upstream_port: int,
    store_port: int,
    plugin: dict | None = None,
    mutate: Any = None,
) -> harness.Envoy:
    """An Envoy from envoy/envoy.yaml (concurrency 2) with only ports, module path and, if
    given, the plugin configuration changed."""
    return procs.envoy(
        harness.default_envoy_config(),
        name=name,
        cluster_ports={UPSTREAM_CLUSTER: upstream_port, STORE_CLUSTER: store_port},
        plugin_config=plugin,
        wasm_path=wasm_path(),
        mutate=mutate,
        concurrency=2,
    )


def store_over_http1(config: dict) -> None:
    """``mutate`` for Envoy: talk HTTP/1.1 to the store cluster (for a fake store that
    cannot speak h2c)."""
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == STORE_CLUSTER:
            cluster.pop("typed_extension_protocol_options", None)


def rule_counter(envoy: harness.Envoy, rule: str, outcome: str) -> int:
    return envoy.stats(filter=r"^wasmcustom\.idempotency\.").get(
        f"wasmcustom.idempotency.rule.{rule}.{outcome}", 0
    )


def rule_counters(envoy: harness.Envoy, rule: str) -> dict[str, int]:
    prefix = f"wasmcustom.idempotency.rule.{rule}."
    return {
        name[len(prefix):]: value
        for name, value in envoy.stats(filter=r"^wasmcustom\.idempotency\.").items()
        if name.startswith(prefix)
    }


# --------------------------------------------------------------------------
# requests
# --------------------------------------------------------------------------


def unique_path(prefix: str = "orders") -> str:
    return f"/{prefix}/{uuid.uuid4().hex}"


def new_key() -> str:
    return str(uuid.uuid4())


def post(
    envoy: harness.Envoy,
    path: str,
    key: str,
    *,
    body: bytes = b'{"sku":"book","qty":1}',
    headers: Mapping[str, str] | None = None,
    timeout: float = TIMEOUT,
) -> requests.Response:
    all_headers = {"Host": HOST, "idempotency-key": key}
    all_headers.update(headers or {})
    return requests.post(envoy.url(path), data=body, headers=all_headers, timeout=timeout)


def is_replay(resp: requests.Response) -> bool:
    return resp.headers.get(REPLAYED) == "true"


def assert_unavailable(resp: requests.Response, rule: str = "orders") -> dict:
    """The fail_closed answer: 503 problem+json, idempotency-unavailable, Retry-After."""
    assert resp.status_code == 503, (resp.status_code, resp.headers, resp.content[:300])
    assert resp.headers.get("content-type") == "application/problem+json", dict(resp.headers)
    assert resp.headers.get("retry-after") == "1", dict(resp.headers)
    doc = resp.json()
    assert doc["type"] == PROBLEM_UNAVAILABLE, doc
    assert doc["status"] == 503 and doc["rule"] == rule, doc
    return doc


def raw_request_bytes(path: str, key: str, *, body: bytes = b'{"sku":"book","qty":1}',
                      headers: Mapping[str, str] | None = None) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {HOST}",
        f"idempotency-key: {key}",
        "content-type: application/json",
        f"content-length: {len(body)}",
    ]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


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


# --------------------------------------------------------------------------
# raw sockets (client disconnects)
# --------------------------------------------------------------------------


def read_response_head(sock: socket.socket, timeout: float) -> tuple[int, dict[str, str], bytes]:
    """Reads until the end of the response headers; (status, headers, body bytes read so far)."""
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while b"\r\n\r\n" not in data:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no response head after {timeout}s: {data[:200]!r}")
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before the response head: {data[:200]!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, rest


def abort(sock: socket.socket) -> None:
    """Closes with RST (SO_LINGER 0), the way a crashed client or a killed pod goes away."""
    import struct

    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@dataclass
class Cluster:
    """A demo upstream, one store, and Envoys from envoy/envoy.yaml sharing that store."""

    upstream: harness.Upstream
    store: Store
    envoys: list[harness.Envoy]
    redis: harness.Redis | None = None

    @property
    def a(self) -> harness.Envoy:
        return self.envoys[0]

    @property
    def b(self) -> harness.Envoy:
        return self.envoys[1]

    def add_envoy(self, procs: harness.ProcessGroup, name: str, plugin: dict | None = None,
                  mutate: Any = None) -> harness.Envoy:
        envoy = start_envoy(procs, name=name, upstream_port=self.upstream.port,
                            store_port=self.store.port, plugin=plugin, mutate=mutate)
        self.envoys.append(envoy)
        return envoy

    def store_completions(self) -> float:
        return self.store.metric("idempotency_store_operations_total", operation="complete",
                                 outcome="completed")


def start_cluster(
    procs: harness.ProcessGroup,
    tmp_path: Path,
    backend: str = "embedded",
    *,
    plugin: dict | None = None,
    envoys: int = 2,
) -> Cluster:
    store = start_backend(procs, tmp_path, backend)
    upstream = procs.upstream()
    cluster = Cluster(upstream=upstream, store=store, envoys=[], redis=store.redis)
    for i in range(envoys):
        cluster.add_envoy(procs, f"envoy-{'abcdefgh'[i]}", plugin)
    return cluster


def wait_for_answer(
    send: Any, timeout: float, *, interval: float = 0.1, what: str = "an answer other than 409"
) -> tuple[requests.Response, list[requests.Response]]:
    """Calls ``send()`` until it answers something other than 409 (bounded by ``timeout``);
    returns that answer and the 409s before it."""
    conflicts: list[requests.Response] = []
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


def complete_while_store_down(envoy: harness.Envoy, cluster: "Cluster", path: str, key: str,
                              *, delay_ms: int = 500) -> bytes:
    """Sends a write through ``envoy`` and stops the store while the upstream works on it; the
    client reads the 201 and hangs up (RST), so the completion can only be delivered by the
    root context. Returns when the filter has seen it fail; the whole body read is returned."""
    with socket.create_connection((harness.LOOPBACK, envoy.port), timeout=10) as sock:
        sock.sendall(raw_request_bytes(path, key, headers={"x-demo-delay-ms": str(delay_ms)}))
        harness.wait_until(lambda: cluster.upstream.executions(path) == 1, timeout=10,
                           what="the upstream to start executing")
        cluster.store.stop()
        status, headers, body = read_response_head(sock, timeout=15)
        assert status == 201 and REPLAYED not in headers, (status, headers)
        while len(body) < int(headers["content-length"]):
            chunk = sock.recv(65536)
            assert chunk, "Envoy closed before the whole body"
            body += chunk
        abort(sock)
    harness.wait_until(lambda: rule_counter(envoy, "orders", "store_error") >= 1, timeout=10,
                       what="the completion to fail against the stopped store")
    return body

"""What the filter's end-to-end tests share: requests through Envoy (over ``client``), the
filter's answers and counters, plugin configurations, Envoys built from envoy/envoy.yaml,
and the log lines that mean the wasm module crashed."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import pytest
import yaml

import client
import harness

WASM_PATH = harness.REPO_ROOT / "target" / "wasm32-unknown-unknown" / "release" / "idempotency_filter.wasm"
PROBLEM_TYPE_BASE = "urn:idempotency-filter:problem:"
REPLAYED = "idempotent-replayed"
BODY_OMITTED = "idempotent-body-omitted"
TIMEOUT = client.TIMEOUT
UPSTREAM_CLUSTER = "demo_upstream"
STORE_CLUSTER = "idempotency_store"
REFUSING_H2_SERVER = Path(__file__).resolve().parent / "refusing_h2_server.py"

# Lines a healthy run never logs: the module's panic hook ("idempotency: panic: ..."), a
# trap in any proxy_on_* callback, or a V8 runtime error with its in-VM backtrace.
# ("trap" alone would match "bootstrap" in Envoy's extension list.)
CRASH_PATTERNS = [
    re.compile(r"\bpanic", re.IGNORECASE),
    re.compile(r"panicked at"),
    re.compile(r"wasm trap", re.IGNORECASE),
    re.compile(r"Function: proxy_on_\w+"),
    re.compile(r"Uncaught RuntimeError"),
    re.compile(r"in-VM backtrace"),
]
# Envoy's own complaints about a VM (not the module's "wasm log ..." lines, which may say
# "store Complete failed" on purpose).
_VM_FAILURE = re.compile(r"failed to .*wasm|wasm.*failed to|wasm vm.*(failed|crash)", re.IGNORECASE)


def wasm_path() -> Path:
    """``$IDEMPOTENCY_FILTER_WASM`` if set, else the module ``make build`` writes."""
    path = Path(os.environ.get("IDEMPOTENCY_FILTER_WASM") or WASM_PATH)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `make build`")
    return path


def unique_path(prefix: str = "orders") -> str:
    """``/<prefix>/<uuid>``: a path no other test uses, so upstream counts are per test."""
    return f"/{prefix.strip('/')}/{uuid.uuid4().hex}"


def new_key() -> str:
    return str(uuid.uuid4())


# --------------------------------------------------------------------------
# requests and answers
# --------------------------------------------------------------------------


def send(
    envoy: harness.Envoy,
    path: str,
    *,
    method: str = "POST",
    key: str | bytes | None = None,
    key_header: str = "idempotency-key",
    body: bytes | str | None = b'{"item":"book","qty":1}',
    headers: client.Headers | None = None,
    session: Any = None,
    timeout: float = TIMEOUT,
) -> client.Response:
    """One request through Envoy; ``key`` goes in ``key_header`` when given. ``headers`` is a
    mapping (overriding the key header), or (name, value) pairs sent as they are, repeated
    names and all."""
    if headers is None or isinstance(headers, Mapping):
        all_headers: Any = {} if key is None else {key_header: key}
        all_headers.update(headers or {})
    else:
        all_headers = ([] if key is None else [(key_header, key)]) + list(headers)
    return client.request(method, envoy.url(path), body=body, headers=all_headers, timeout=timeout,
                          client=session)


def post(envoy: harness.Envoy, path: str, **kwargs: Any) -> client.Response:
    return send(envoy, path, method="POST", **kwargs)


def is_replay(resp: client.Response, header: str = REPLAYED) -> bool:
    return resp.headers.get(header) == "true"


def problem(resp: client.Response, status: int, kind: str, rule: str | None = None) -> dict:
    """Asserts an RFC 9457 answer of the filter and returns its JSON body."""
    headers = resp.headers
    assert resp.status_code == status, f"expected {status} {kind}, got {resp.status_code}: {resp.content[:300]!r}"
    assert headers.get("content-type") == "application/problem+json", dict(headers)
    doc = json.loads(resp.content)
    assert doc["type"] == PROBLEM_TYPE_BASE + kind, doc
    assert doc["status"] == status, doc
    assert doc["title"] and doc["detail"], doc
    if rule is not None:
        assert doc["rule"] == rule, doc
    return doc


def rule_counters(envoy: harness.Envoy, rule_name: str) -> dict[str, int]:
    """The filter's outcome counters of one rule, by outcome (Envoy admin /stats)."""
    prefix = f"wasmcustom.idempotency.rule.{rule_name}."
    return {
        name[len(prefix):]: value
        for name, value in envoy.stats(filter="^" + re.escape(prefix)).items()
        if name.startswith(prefix)
    }


def rule_counter(envoy: harness.Envoy, rule_name: str, outcome: str) -> int:
    return rule_counters(envoy, rule_name).get(outcome, 0)


def worker_connections(envoy: harness.Envoy) -> list[int]:
    """Connections each Envoy worker accepted on the main listener, in worker order."""
    stats = envoy.stats(r"^listener\.127\.0\.0\.1_\d+\.worker_\d+\.downstream_cx_total$")
    listener = f"listener.127.0.0.1_{envoy.port}."
    counts = {name: value for name, value in stats.items() if name.startswith(listener)}
    return [counts[name] for name in sorted(counts)]


# --------------------------------------------------------------------------
# plugin configuration
# --------------------------------------------------------------------------


def rule(name: str, *, prefixes: Iterable[str] = (), **fields: Any) -> dict:
    """One rule; ``prefixes`` fills ``match.path_prefixes``, other fields are taken as is
    (``match`` given explicitly wins)."""
    out: dict[str, Any] = {"name": name}
    prefixes = list(prefixes)
    if prefixes:
        out["match"] = {"path_prefixes": prefixes}
    out.update(fields)
    return out


def plugin_config(*rules: dict, capacity: int | None = None, **top: Any) -> dict:
    config: dict[str, Any] = {}
    if capacity is not None:
        config["local_table"] = {"capacity": capacity}
    config.update(top)
    config["rules"] = list(rules)
    return config


def envoy_yaml_plugin_config() -> dict:
    """The plugin configuration of envoy/envoy.yaml, as users get it (a fresh copy)."""
    config = yaml.safe_load(harness.default_envoy_config().read_text())
    return copy.deepcopy(harness.get_plugin_configuration(config))


def sample_single_proxy_config() -> dict:
    """The plugin configuration of envoy/envoy.yaml without its ``store`` section: what
    that file tells users to do for single-proxy mode."""
    config = envoy_yaml_plugin_config()
    config.pop("store", None)
    for each in config.get("rules", []):
        each.pop("store", None)
    return config


def envoy_options(upstream: harness.Upstream, config: Any, *, store_port: int | None = None) -> dict:
    """``harness.Envoy`` keyword arguments for envoy/envoy.yaml: the demo cluster on
    ``upstream``, the store cluster on ``store_port`` (by default a port nothing listens on:
    single-proxy mode has no store), the freshly built module, and ``config`` as plugin
    configuration (None keeps envoy.yaml's)."""
    ports = {UPSTREAM_CLUSTER: upstream.port}
    clusters = yaml.safe_load(harness.default_envoy_config().read_text())["static_resources"]["clusters"]
    for cluster in clusters:
        if cluster["name"] != UPSTREAM_CLUSTER:
            ports[cluster["name"]] = harness.free_port()
    if store_port is not None:
        ports[STORE_CLUSTER] = store_port
    return {"cluster_ports": ports, "wasm_path": wasm_path(), "plugin_config": config}


def start_envoy(procs: harness.ProcessGroup, upstream: harness.Upstream, config: Any, *,
                store_port: int | None = None, **kwargs: Any) -> harness.Envoy:
    """An Envoy from envoy/envoy.yaml with only its ports, the module and (unless ``config``
    is None) the plugin configuration changed; ``kwargs`` go to ``harness.Envoy`` (name,
    mutate, concurrency, ...)."""
    return procs.envoy(harness.default_envoy_config(), **kwargs,
                       **envoy_options(upstream, config, store_port=store_port))


def add_refused_cluster(config: dict) -> None:
    """Adds the cluster ``refused`` to an Envoy config (for a ``mutate``): one endpoint on a
    loopback port nobody listens on, so every connection to it is refused."""
    config["static_resources"]["clusters"].append({
        "name": "refused",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "refused", "endpoints": [{"lb_endpoints": [{
            "endpoint": {"address": {"socket_address": {
                "address": harness.LOOPBACK, "port_value": harness.free_port()}}}}]}]},
    })


@dataclass
class RefusingH2Server:
    """``refusing_h2_server.py`` running: an HTTP/2 upstream that refuses the first stream
    of every idempotency key unprocessed and executes the later ones."""

    process: harness.ManagedProcess
    port: int
    control_port: int

    def counts(self) -> dict[str, dict[str, int]]:
        resp = client.get(f"http://{harness.LOOPBACK}:{self.control_port}/counts", timeout=5)
        resp.raise_for_status()
        return resp.json()

    def refused(self, key: str) -> int:
        return self.counts()["refused"].get(key, 0)

    def executions(self, key: str) -> int:
        return self.counts()["executions"].get(key, 0)


def start_refusing_h2_server(procs: harness.ProcessGroup) -> RefusingH2Server:
    port, control_port = harness.free_port(), harness.free_port()
    proc = procs.process([sys.executable, str(REFUSING_H2_SERVER), "--port", str(port),
                          "--control-port", str(control_port)], name="refusing-h2")
    # The control port is served before the HTTP/2 one listens.
    harness.wait_for_tcp(port, timeout=20, proc=proc)
    return RefusingH2Server(proc, port, control_port)


def add_h2_cluster(config: dict, name: str, port: int) -> None:
    """Adds the cluster ``name`` to an Envoy config (for a ``mutate``): one loopback endpoint
    on ``port`` that Envoy speaks HTTP/2 to (cleartext, prior knowledge)."""
    config["static_resources"]["clusters"].append({
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{
            "endpoint": {"address": {"socket_address": {
                "address": harness.LOOPBACK, "port_value": port}}}}]}]},
    })


def prepend_routes(config: dict, routes: list[dict]) -> None:
    """Puts ``routes`` ahead of the catch-all in the first virtual host of an Envoy config
    (for a ``mutate``): a test's own timeouts and retry policies on paths of its own."""
    hcm = next(f["typed_config"] for listener in config["static_resources"]["listeners"]
               for chain in listener["filter_chains"] for f in chain["filters"]
               if f["name"] == "envoy.filters.network.http_connection_manager")
    hcm["route_config"]["virtual_hosts"][0]["routes"][:0] = routes


@contextlib.contextmanager
def module_envoy(tmpdir: Path, name: str, config: Any, **kwargs: Any) -> Iterator[tuple[harness.Envoy, harness.Upstream]]:
    """For a module's fixture: an upstream and an Envoy from envoy.yaml with ``config`` that
    the module's tests share; on the way out, the Envoy's log must show no crash."""
    with harness.ProcessGroup(tmpdir) as group:
        upstream = group.upstream()
        envoy = start_envoy(group, upstream, config, name=name, **kwargs)
        yield envoy, upstream
        assert not crash_lines(envoy.log_text())


# --------------------------------------------------------------------------
# logs
# --------------------------------------------------------------------------


def access_lines(envoy: harness.Envoy) -> list[dict]:
    """The JSON access-log lines (envoy/envoy.yaml's format) among everything Envoy printed."""
    lines = []
    for line in envoy.log_text().splitlines():
        if line.startswith("{") and '"idempotency_outcome"' in line:
            lines.append(json.loads(line))
    return lines


def line_for(envoy: harness.Envoy, request_id: str) -> dict:
    """The one access-log line of the request sent with ``x-request-id: request_id``."""
    found: list[dict] = []

    def logged() -> bool:
        found[:] = [e for e in access_lines(envoy) if e.get("request_id") == request_id]
        return bool(found)

    # The access log is flushed by Envoy on its own schedule.
    harness.wait_until(logged, timeout=15, what=f"access log line of {request_id}")
    assert len(found) == 1, found
    return found[0]


def crash_lines(text: str, *, vm_failures: bool = False) -> list[str]:
    """Lines showing a panic or a trap; with ``vm_failures``, also Envoy's complaints
    about a failed VM."""
    return [
        line
        for line in text.splitlines()
        if any(p.search(line) for p in CRASH_PATTERNS)
        or (vm_failures and "wasm log " not in line and _VM_FAILURE.search(line))
    ]


# A test of `resolve` or of detached writes whose rules take the route's cluster: the native
# build on Envoy 1.39 cannot read it (harness.native_without_route_facts).
needs_route_cluster = pytest.mark.skipif(
    harness.native_without_route_facts(),
    reason="this Envoy's dynamic modules give no route cluster (xds.cluster_name, Envoy 1.40+): "
           "these rules take it from the route")

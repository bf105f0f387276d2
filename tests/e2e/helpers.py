"""Small helpers for the filter's end-to-end tests: requests, problem bodies, plugin configs,
and the log patterns that mean the wasm module crashed."""

from __future__ import annotations

import http.client
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping

import requests
import yaml

import harness

WASM_PATH = harness.REPO_ROOT / "target" / "wasm32-unknown-unknown" / "release" / "idempotency_filter.wasm"
PROBLEM_TYPE_BASE = "urn:idempotency-filter:problem:"
REPLAYED = "idempotent-replayed"
BODY_OMITTED = "idempotent-body-omitted"
TIMEOUT = 20.0

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


def wasm_path() -> Path:
    """``$IDEMPOTENCY_FILTER_WASM`` if set, else the module ``make build`` writes."""
    path = Path(os.environ.get("IDEMPOTENCY_FILTER_WASM") or WASM_PATH)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run `make build`")
    return path


def unique_path(prefix: str) -> str:
    """``/<prefix>/<uuid>``: a path no other test uses, so upstream counts are per test."""
    return f"/{prefix.strip('/')}/{uuid.uuid4().hex}"


def new_key() -> str:
    return str(uuid.uuid4())


def send(
    envoy: harness.Envoy,
    path: str,
    *,
    method: str = "POST",
    key: str | bytes | None = None,
    key_header: str = "idempotency-key",
    body: bytes | str | None = b'{"item":"book","qty":1}',
    headers: Mapping[str, str | bytes] | None = None,
    session: requests.Session | None = None,
    timeout: float = TIMEOUT,
) -> requests.Response:
    """One request through Envoy; ``key`` goes in ``key_header`` when given."""
    all_headers: dict[str, str | bytes] = {}
    if key is not None:
        all_headers[key_header] = key
    if headers:
        all_headers.update(headers)
    client = session if session is not None else requests
    return client.request(method, envoy.url(path), data=body, headers=all_headers, timeout=timeout)


def post(envoy: harness.Envoy, path: str, **kwargs: Any) -> requests.Response:
    return send(envoy, path, method="POST", **kwargs)


def is_replay(resp: requests.Response, header: str = REPLAYED) -> bool:
    return resp.headers.get(header) == "true"


def problem(resp: requests.Response | "RawResponse", status: int, kind: str, rule: str | None = None) -> dict:
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


class RawResponse:
    """What ``raw_request`` got back (header names lower-cased)."""

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code = status_code
        self.headers = headers
        self.content = content


def raw_request(
    envoy: harness.Envoy,
    path: str,
    headers: Iterable[tuple[str, bytes]],
    *,
    method: str = "POST",
    body: bytes = b"{}",
    timeout: float = TIMEOUT,
) -> RawResponse:
    """Sends header values byte for byte (http.client does not re-encode bytes), for values
    ``requests`` would refuse or normalise."""
    conn = http.client.HTTPConnection(harness.LOOPBACK, envoy.port, timeout=timeout)
    try:
        conn.putrequest(method, path)
        for name, value in headers:
            conn.putheader(name, value)
        conn.putheader("content-length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        content = resp.read()
        return RawResponse(resp.status, {k.lower(): v for k, v in resp.getheaders()}, content)
    finally:
        conn.close()


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


def sample_single_proxy_config() -> dict:
    """The plugin configuration of envoy/envoy.yaml without its ``store`` section: what
    that file tells users to do for single-proxy mode."""
    config = harness.get_plugin_configuration(yaml.safe_load(harness.default_envoy_config().read_text()))
    config.pop("store", None)
    for each in config.get("rules", []):
        each.pop("store", None)
    return config


def envoy_options(upstream: harness.Upstream, config: Any) -> dict:
    """``harness.Envoy`` keyword arguments for envoy/envoy.yaml in single-proxy mode: the demo
    cluster on ``upstream``, the store cluster (unused without a ``store`` section) on a
    port nothing listens on, the freshly built module, and ``config`` as plugin config."""
    ports = {"demo_upstream": upstream.port}
    clusters = yaml.safe_load(harness.default_envoy_config().read_text())["static_resources"]["clusters"]
    for cluster in clusters:
        if cluster["name"] != "demo_upstream":
            ports[cluster["name"]] = harness.free_port()
    return {"cluster_ports": ports, "wasm_path": wasm_path(), "plugin_config": config}


def crash_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(p.search(line) for p in CRASH_PATTERNS)]

"""The gRPC tests' pieces: the real gRPC server (``grpc_service.py``, grpcio) as a process,
Envoys built from envoy/envoy-grpc.yaml in front of it (alone, or sharing a store), and calls
made with grpcio's own client, whose retry policy is the one users configure.

Everything on 127.0.0.1; processes are started and stopped by the harness, by PID."""

from __future__ import annotations

import json
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import grpc
import yaml

import harness
from helpers import STORE_CLUSTER, wasm_path

GRPC_ENVOY_YAML = harness.REPO_ROOT / "envoy" / "envoy-grpc.yaml"
SERVICE_CLUSTER = "orders_grpc"
PLACE = "/shop.v1.Orders/PlaceOrder"
SERVER_SCRIPT = Path(__file__).resolve().parent / "grpc_service.py"
TOKEN = "grpc-test-token"
AUTHORITY = "shop.test"


@dataclass
class GrpcServer:
    process: harness.ManagedProcess
    port: int

    def counts(self) -> dict[str, dict[str, int]]:
        """What the server saw, asked directly (not through Envoy)."""
        with grpc.insecure_channel(f"{harness.LOOPBACK}:{self.port}") as channel:
            raw = channel.unary_unary("/test.v1.Control/Executions")(b"", timeout=5)
        return json.loads(raw)

    def executions(self, key: str) -> int:
        return self.counts()["executions"].get(key, 0)

    def attempts(self, key: str) -> int:
        return self.counts()["attempts"].get(key, 0)


def start_server(procs: harness.ProcessGroup) -> GrpcServer:
    port = harness.free_port()
    proc = procs.process([sys.executable, str(SERVER_SCRIPT), "--port", str(port)], name="grpc-service")
    harness.wait_for_tcp(port, timeout=20, proc=proc)
    return GrpcServer(proc, port)


def yaml_plugin_config() -> dict:
    """envoy-grpc.yaml's own plugin configuration of the filter."""
    config = yaml.safe_load(GRPC_ENVOY_YAML.read_text())
    return harness.get_plugin_configuration(config)


def plugin_config(**orders: Any) -> dict:
    """envoy-grpc.yaml's plugin configuration with fields of its ``orders`` rule changed."""
    config = yaml_plugin_config()
    config["rules"][0].update(orders)
    return config


def with_store(plugin: dict, store_port: int) -> Any:
    """A ``mutate`` adding the store's cluster; ``plugin`` gets the store section."""
    plugin["store"] = {"cluster": STORE_CLUSTER, "authority": "idempotency-store", "timeout_ms": 500,
                       "token": TOKEN}

    def mutate(config: dict) -> None:
        config["static_resources"]["clusters"].append({
            "name": STORE_CLUSTER,
            "type": "STATIC",
            "connect_timeout": "0.25s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            },
            "load_assignment": {"cluster_name": STORE_CLUSTER, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": harness.LOOPBACK,
                                                              "port_value": store_port}}}}]}]},
        })
    return mutate


def route_timeout(seconds: float) -> Any:
    """A ``mutate`` setting the service route's timeout."""
    def mutate(config: dict) -> None:
        for route in harness._walk_dicts(config):
            if route.get("route", {}).get("cluster") == SERVICE_CLUSTER:
                route["route"]["timeout"] = f"{seconds}s"
    return mutate


def upstream_never_learns_the_deadline(config: dict) -> None:
    """``mutate``: the service route drops ``grpc-timeout`` on its way upstream, so a client's
    deadline passing is the client cancelling the call, never the service's own gRPC library
    answering DEADLINE_EXCEEDED at the same instant (an answer of the service's, which the
    filter records and replays): which of the two came first was a race."""
    for route in harness._walk_dicts(config):
        if route.get("route", {}).get("cluster") == SERVICE_CLUSTER:
            route.setdefault("request_headers_to_remove", []).append("grpc-timeout")


ECHO = "idempotency_replay_echo"


def without_replay_echo(config: dict) -> None:
    """``mutate``: the echo's internal listener, its cluster and the route to it gone, as the
    native build's configuration has them (it sends no hops)."""
    resources = config.get("static_resources", {})
    resources["listeners"] = [lst for lst in resources.get("listeners", []) if lst.get("name") != ECHO]
    resources["clusters"] = [c for c in resources.get("clusters", []) if c.get("name") != ECHO]
    for vhost in harness._walk_dicts(config):
        routes = vhost.get("routes")
        if isinstance(routes, list):
            vhost["routes"] = [r for r in routes if r.get("route", {}).get("cluster") != ECHO]


def grpc_envoy(procs: harness.ProcessGroup, server: GrpcServer, plugin: dict | None = None, *,
               name: str = "envoy-grpc", mutate: Any = None, keep_echo: bool = False) -> harness.Envoy:
    """An Envoy from envoy-grpc.yaml in front of ``server``, registered, not started. On the
    native build without the replay echo (``keep_echo`` keeps it): a replay there must not need it."""
    def build_config(config: dict) -> dict:
        if harness.FILTER_BUILD == "native" and not keep_echo:
            without_replay_echo(config)
        if mutate is not None:
            config = mutate(config) or config
        return config
    return procs.add(harness.Envoy(
        GRPC_ENVOY_YAML,
        procs.tmpdir,
        cluster_ports={SERVICE_CLUSTER: server.port},
        plugin_config=plugin if plugin is not None else yaml_plugin_config(),
        wasm_path=wasm_path(),
        mutate=build_config,
        name=name,
    ))


def start_envoy(procs: harness.ProcessGroup, server: GrpcServer, plugin: dict | None = None, *,
                name: str = "envoy-grpc", mutate: Any = None, keep_echo: bool = False) -> harness.Envoy:
    return grpc_envoy(procs, server, plugin, name=name, mutate=mutate, keep_echo=keep_echo).start()


@dataclass
class Answer:
    """How a call ended, as the client library reports it."""

    code: grpc.StatusCode
    message: bytes | None
    details: str | None
    initial: dict[str, Any] = field(default_factory=dict)
    trailing: dict[str, Any] = field(default_factory=dict)


def _metadata(pairs: Iterable[Any] | None) -> dict[str, Any]:
    return {m.key: m.value for m in (pairs or ())}


def retry_policy(codes: Iterable[str], attempts: int = 4) -> str:
    """A service config whose retry policy (gRPC A6) covers PlaceOrder."""
    return json.dumps({"methodConfig": [{
        "name": [{"service": "shop.v1.Orders", "method": "PlaceOrder"}],
        "retryPolicy": {
            "maxAttempts": attempts,
            "initialBackoff": "0.1s",
            "maxBackoff": "2s",
            "backoffMultiplier": 2,
            "retryableStatusCodes": list(codes),
        },
    }]})


def channel(envoy: harness.Envoy, service_config: str | None = None) -> grpc.Channel:
    # One authority for every Envoy: it is part of the key's default scope, and replicas
    # behind a load balancer see the same one.
    options: list[tuple[str, Any]] = [
        ("grpc.enable_retries", 1 if service_config else 0),
        ("grpc.default_authority", AUTHORITY),
    ]
    if service_config:
        options.append(("grpc.service_config", service_config))
    return grpc.insecure_channel(f"{harness.LOOPBACK}:{envoy.port}", options=options)


def call(target: harness.Envoy | grpc.Channel, key: str | None, message: bytes = b"order", *,
         metadata: Iterable[tuple[str, str]] = (), timeout: float = 10.0,
         method: str = PLACE) -> Answer:
    """One unary call (through the channel's retry policy, if it has one)."""
    own = not isinstance(target, grpc.Channel)
    ch = channel(target) if own else target
    md = list(metadata) + ([("idempotency-key", key)] if key is not None else [])
    try:
        response, c = ch.unary_unary(method).with_call(message, metadata=md, timeout=timeout)
        return Answer(c.code(), response, c.details(), _metadata(c.initial_metadata()),
                      _metadata(c.trailing_metadata()))
    except grpc.RpcError as e:
        return Answer(e.code(), None, e.details(), _metadata(e.initial_metadata()),
                      _metadata(e.trailing_metadata()))
    finally:
        if own:
            ch.close()


def new_key() -> str:
    return f"grpc-{uuid.uuid4().hex}"


def recorded_copy(answer: Answer) -> dict[str, Any]:
    """What a replay must give back of an answer: everything but per-response values."""
    skip = {"date", "server", "x-envoy-upstream-service-time", "idempotent-replayed"}
    return {
        "code": answer.code,
        "message": answer.message,
        "details": answer.details,
        "initial": {k: v for k, v in answer.initial.items() if k not in skip},
        "trailing": {k: v for k, v in answer.trailing.items() if k not in skip},
    }


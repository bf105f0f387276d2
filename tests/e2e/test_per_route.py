"""The filter on the write routes only, through real Envoy: envoy/envoy-per-route.yaml keeps it
out of the chain (`disabled: true`) and turns it on per route with a FilterConfig, so a route
that does not list it never enters the Wasm module (docs/configuration.md "Enabling the filter
per route")."""

from __future__ import annotations

import copy
from typing import Any

import yaml

import harness
from helpers import (
    REPLAYED,
    UPSTREAM_CLUSTER,
    crash_lines,
    new_key,
    post,
    rule,
    send,
    unique_path,
    wasm_path,
)

SAMPLE = harness.REPO_ROOT / "envoy" / "envoy-per-route.yaml"
# The test's witness: a rule every request the module sees would meet (see the test below).
WITNESS = "witness"
EVERY_METHOD = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def sample_envoy_config() -> dict:
    return yaml.safe_load(SAMPLE.read_text())


def witnessed_plugin_config() -> dict:
    """The sample's plugin configuration, its rules first, then the witness: any method, any
    path, an optional key. A request no sample rule takes and that the module sees would meet
    it, so it leaves a count (`passed_through` without a key; `executed`, then `replayed`, with
    one)."""
    config = copy.deepcopy(harness.get_plugin_configuration(sample_envoy_config()))
    config["rules"].append(rule(WITNESS, match={"methods": EVERY_METHOD}, key={"required": False}))
    return config


def sample_options(upstream: harness.Upstream) -> dict[str, Any]:
    """``harness.Envoy`` keyword arguments for the sample: only its ports and the module path
    changed."""
    return {"cluster_ports": {UPSTREAM_CLUSTER: upstream.port}, "wasm_path": wasm_path()}


def module_counts(envoy: harness.Envoy) -> dict[str, int]:
    """Every outcome counter of every rule, nonzero ones only."""
    counters = envoy.stats(filter=r"^wasmcustom\.idempotency\.rule\.")
    return {name: value for name, value in counters.items() if value}


def test_the_write_routes_are_protected_and_no_other_route_enters_the_module(procs, upstream) -> None:
    """A write on the sample's write route is protected (executed once, replayed, looked up
    on its lookup route); reads and writes on the routes that do not list the filter reach the
    upstream every time and leave no count in the module.

    No counter of the filter counts every request the module sees: its counters are per rule
    and outcome, and a request no rule matches passes without one (Envoy's own wasm stats
    count VMs and reloads, not requests). So the test adds a witness rule after the sample's
    that matches every method and path with an optional key: any request the module saw would
    be counted under it, and one with a key would be claimed, its repeat replayed. The
    unlisted routes' requests change no counter and all run twice; take the FilterConfig off
    the write route and the write is not replayed; drop `disabled: true` and the witness
    counts them."""
    envoy = procs.envoy(SAMPLE, name="envoy-per-route", plugin_config=witnessed_plugin_config(),
                        **sample_options(upstream))

    # The write route: protected by the sample's rule.
    path, key = unique_path("orders"), new_key()
    first = post(envoy, path, key=key)
    assert first.status_code == 201 and REPLAYED not in first.headers, first.content[:300]
    retry = post(envoy, path, key=key)
    assert retry.headers.get(REPLAYED) == "true" and retry.content == first.content
    assert upstream.executions(path) == 1
    status = send(envoy, "/orders/idempotency-status", method="GET", key=key, body=None)
    assert status.status_code == 200 and status.json()["state"] == "completed", status.content[:300]
    seen = module_counts(envoy)
    assert seen == {
        "wasmcustom.idempotency.rule.orders.executed": 1,
        "wasmcustom.idempotency.rule.orders.replayed": 1,
        "wasmcustom.idempotency.rule.orders.looked_up": 1,
    }, seen

    # The routes without the filter, each request sent twice with one key and once without:
    # a read on the protected path, a write with a method the write route leaves out, a write
    # elsewhere.
    unlisted = [("GET", unique_path("orders"), None), ("PUT", unique_path("orders"), b'{"item":"pen"}'),
                ("POST", unique_path("search"), b'{"q":"pen"}')]
    answers = []
    for method, unlisted_path, body in unlisted:
        unlisted_key = new_key()
        for key_or_none in (unlisted_key, unlisted_key, None):
            answers.append((method, send(envoy, unlisted_path, method=method, key=key_or_none, body=body)))
    assert module_counts(envoy) == seen, "the module saw a request on a route without the filter"
    for method, resp in answers:
        assert resp.status_code == 201 and REPLAYED not in resp.headers, (method, resp.content[:300])
    assert [upstream.executions(p) for _, p, _ in unlisted] == [3, 3, 3]
    assert not crash_lines(envoy.log_text())


def test_an_empty_filter_config_alone_is_refused(procs, upstream) -> None:
    """`disabled: false` without `config` is the obvious way to turn the filter on for a
    route, and Envoy refuses it: the sample's empty `config` is the form that loads."""
    def without_config(config: dict) -> None:
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
        writes = next(r for r in routes if r["name"] == "orders-writes")
        writes["typed_per_filter_config"]["idempotency"] = {
            "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig", "disabled": False}

    as_shipped = harness.Envoy(SAMPLE, procs.tmpdir, name="envoy-sample", **sample_options(upstream))
    assert as_shipped.validate_config()[0]
    refused = harness.Envoy(SAMPLE, procs.tmpdir, name="envoy-disabled-false", mutate=without_config,
                            **sample_options(upstream))
    ok, output = refused.validate_config()
    assert not ok
    assert "Empty route/virtual host per filter configuration for idempotency filter" in output, \
        output[-2000:]

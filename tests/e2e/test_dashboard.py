"""The Grafana dashboard in deploy/grafana/ against what the code really exports, both ways:
every metric and label its queries name must appear on a real Envoy's /stats/prometheus (with
envoy/envoy.yaml's stats_tags) or on the real store's /metrics, after some traffic; and every
metric those two pages export must be on the dashboard or in LEFT_OFF, with its reason.
One dashboard serves both builds: it selects each of the filter's metrics by a name that
matches the Wasm build's (`idempotency_…`) and the native build's
(`envoy_dynamicmodulescustom_idempotency_…`), and these tests run on either."""

from __future__ import annotations

import json
import re

import client
import harness
from cluster import cluster_plugin_config, post, start_cluster
from helpers import envoy_yaml_plugin_config, new_key, unique_path

DASHBOARD = harness.REPO_ROOT / "deploy" / "grafana" / "idempotency-dashboard.json"

# Metrics (Prometheus family names, as on the pages' `# TYPE` lines) deliberately not on the
# dashboard, each with why. Empty while every metric has a panel; an entry that is on the
# dashboard after all, or that nothing exports any more, fails the test.
LEFT_OFF: dict[str, str] = {}
# What a family's samples add to its name: counters' `_total` (OpenMetrics; Envoy's counters
# have none) and histograms' series.
SAMPLE_SUFFIXES = ("_total", "_bucket", "_sum", "_count")

# PromQL words that are not metric names.
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "rate", "irate", "increase", "histogram_quantile",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "label_values", "topk", "bottomk", "clamp_min", "clamp_max", "abs", "offset",
}
# Labels Prometheus adds when it scrapes, not the exporter.
SCRAPE_LABELS = {"instance", "job"}
IDENT = r"[A-Za-z_:][A-Za-z0-9_:]*"
# How the dashboard names a filter metric: either build's name (the native build's Prometheus
# names carry Envoy's dynamic modules prefix).
EITHER_BUILD = re.compile(r'\{__name__=~"\(envoy_dynamicmodulescustom_\)\?(' + IDENT + r')"(?:,\s*)?')
NATIVE_PREFIX = "envoy_dynamicmodulescustom_"


def by_wasm_names(page: str) -> str:
    """An Envoy stats page with the native build's metric names as the Wasm build's."""
    return page.replace(NATIVE_PREFIX, "")


def filter_metric(name: str) -> bool:
    """A metric of the filter's (`idempotency_rule` is its rule label, not a metric)."""
    return name.startswith("idempotency_") and not name.startswith("idempotency_store_") and name != "idempotency_rule"


def queries(dashboard: dict) -> list[str]:
    found = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var.get("type") == "query":
            found.append(var["definition"])
    return found


def names_in(expr: str, *, either_build: bool = True) -> tuple[set[str], dict[str, set[str]], set[str]]:
    """(metric names, labels matched per metric, labels grouped by) of one query; with
    ``either_build``, a metric selected by either build's name counts under the Wasm one."""
    if either_build:
        expr = EITHER_BUILD.sub(r"\1{", expr).replace("{}", "")
    matched: dict[str, set[str]] = {}
    for metric, matchers in re.findall(rf"({IDENT})\{{([^}}]*)\}}", expr):
        matched.setdefault(metric, set()).update(re.findall(rf"({IDENT})\s*=~?", matchers))
    grouped = {
        label for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
        for label in re.findall(IDENT, group)
    }
    # label_values(metric, label): the second argument is a label.
    grouped |= set(re.findall(rf"label_values\(\s*{IDENT}\s*,\s*({IDENT})\s*\)", expr))
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"|\b(?:by|without)\s*\([^)]*\)", " ", expr)
    bare = re.sub(rf"label_values\(\s*({IDENT})\s*,\s*{IDENT}\s*\)", r"\1", bare)
    metrics = {
        word for word in re.findall(IDENT, bare)
        if word not in PROMQL_WORDS and not re.fullmatch(r"[0-9.e]+", word)
    }
    return metrics, matched, grouped


def samples(text: str) -> dict[str, set[str]]:
    """Sample name -> every label name it carries, from a Prometheus/OpenMetrics text page. A
    family declared with no sample yet (a counter nothing has moved, such as backend errors)
    is there with no labels, under the sample names its type gives."""
    out: dict[str, set[str]] = {}
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    for line in text.splitlines():
        declared = re.match(rf"# TYPE ({IDENT}) (\w+)", line)
        if declared:
            family, kind = declared.groups()
            for suffix in suffixes.get(kind, [""]):
                name = family if family.endswith(suffix) else family + suffix
                out.setdefault(name, set())
            continue
        if line.startswith("#") or not line.strip():
            continue
        match = re.match(rf"({IDENT})(?:\{{([^}}]*)\}})?\s", line)
        if match:
            labels = set(re.findall(rf"({IDENT})=\"", match.group(2) or ""))
            out.setdefault(match.group(1), set()).update(labels)
    return out


def families(text: str) -> set[str]:
    """Every metric family a Prometheus/OpenMetrics text page declares (its `# TYPE` lines),
    whether or not it has a sample yet."""
    return set(re.findall(rf"^# TYPE ({IDENT}) \w+$", text, flags=re.MULTILINE))


def dashboard_metrics(dashboard: dict) -> set[str]:
    return {metric for expr in queries(dashboard) for metric in names_in(expr)[0]}


def on_dashboard(family: str, metrics: set[str]) -> bool:
    return any(family + suffix in metrics for suffix in ("", *SAMPLE_SUFFIXES))


def test_every_filter_metric_is_selected_by_either_builds_name() -> None:
    """A query naming a filter metric the Wasm way only would show nothing for the native
    build (and the other way round)."""
    for expr in queries(json.loads(DASHBOARD.read_text())):
        metrics = names_in(expr, either_build=False)[0]
        assert not {m for m in metrics if filter_metric(m)}, f"a filter metric by one build's name only in {expr!r}"


def test_panels_have_unique_ids_and_do_not_overlap() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"panel ids must be unique: {sorted(ids)}"
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, f"{panel['title']} is off the 24-column grid"
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_every_metric_the_filter_and_the_store_export_is_on_the_dashboard_or_left_off(procs) -> None:
    """The metrics come from the real exporters, read before any traffic: the filter defines
    every counter of every rule (one per outcome) and its gauge when it loads its
    configuration, so Envoy lists them all at 0 from the start (checked below: each counter
    has a series for every rule of envoy/envoy.yaml); the store declares every family when it
    starts, with or without samples (`# TYPE` lines), and the embedded backend is the one that
    registers metrics of its own. Envoy's own metrics (`envoy_...`) are not the filter's."""
    cluster = start_cluster(procs, envoys=1, plugin=cluster_plugin_config())
    envoy_page = by_wasm_names(cluster.a.admin("/stats/prometheus").text)
    filter_families = {f for f in families(envoy_page) if not f.startswith("envoy_")}
    store_families = families(client.get(cluster.store.url("/metrics"), timeout=5).text)

    # The premise: the pages are whole before traffic.
    rules = {rule["name"] for rule in envoy_yaml_plugin_config()["rules"]}
    per_rule = sorted(f for f in filter_families if f.startswith("idempotency_rule_"))
    assert "idempotency_rule_executed" in per_rule, sorted(filter_families)
    for family in per_rule:
        labelled = set(re.findall(rf'^{family}\{{idempotency_rule="([^"]*)"\}}', envoy_page,
                                  flags=re.MULTILINE))
        assert labelled == rules, f"{family}: series for {sorted(labelled)}, rules {sorted(rules)}"
    assert "idempotency_store_operations" in store_families, sorted(store_families)

    exported = filter_families | store_families
    shown = dashboard_metrics(json.loads(DASHBOARD.read_text()))
    missing = sorted(f for f in exported if not on_dashboard(f, shown) and f not in LEFT_OFF)
    assert not missing, f"exported, but neither on the dashboard nor in LEFT_OFF: {missing}"
    stale = sorted(f for f in LEFT_OFF if f not in exported)
    assert not stale, f"in LEFT_OFF, but exported by neither Envoy nor the store: {stale}"
    both = sorted(f for f in LEFT_OFF if on_dashboard(f, shown))
    assert not both, f"in LEFT_OFF, but on the dashboard: {both}"


def test_every_dashboard_query_names_a_metric_and_labels_the_code_exports(procs) -> None:
    dashboard = json.loads(DASHBOARD.read_text())

    # envoy.yaml itself (cluster mode, embedded store): its stats_tags make the rule a label.
    cluster = start_cluster(procs, envoys=1, plugin=cluster_plugin_config())
    envoy = cluster.a
    path, key = unique_path("orders"), new_key()
    assert post(envoy, path, key).status_code == 201
    assert post(envoy, path, key).headers.get("idempotent-replayed") == "true"
    assert post(envoy, path, key, body=b'{"other":1}').status_code == 422
    # A store request with a wrong token gives the store's refusal counter a sample.
    refused = client.post(cluster.store.url("/v1/claim"), body=b"{}",
                                  headers={"authorization": "Bearer wrong"}, timeout=5)
    assert refused.status_code == 401
    harness.wait_until(lambda: cluster.store_completions() >= 1, timeout=10, what="completion stored")

    exported = samples(by_wasm_names(envoy.admin("/stats/prometheus").text))
    store_samples = samples(client.get(cluster.store.url("/metrics"), timeout=5).text)
    for name, labels in store_samples.items():
        exported.setdefault(name, set()).update(labels)

    checked = set()
    for expr in queries(dashboard):
        metrics, matched, grouped = names_in(expr)
        assert metrics, f"no metric found in {expr!r}"
        for metric in metrics:
            assert metric in exported, f"{metric} (in {expr!r}) is exported by neither Envoy nor the store"
            checked.add(metric)
            for label in matched.get(metric, set()):
                assert label in exported[metric], f"{metric} has no label {label} (in {expr!r})"
        with_samples = [m for m in metrics if exported[m]]
        for label in grouped - SCRAPE_LABELS - {"le"}:
            assert not with_samples or any(label in exported[m] for m in with_samples), (
                f"no metric of {expr!r} has label {label}"
            )

    # What on-call watches must be on the board.
    for outcome in ("executed", "replayed", "conflict", "mismatch", "store_error", "store_write_dropped"):
        assert f"idempotency_rule_{outcome}" in checked, outcome
    assert "idempotency_store_operation_duration_seconds_bucket" in checked

"""One version for the whole product: every crate takes the workspace's, the store prints it,
the filter logs it when its VM starts, and the changelog starts with it."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib

import harness
import helpers
from containers import workspace_version

REPO = harness.REPO_ROOT


def test_every_crate_takes_the_workspace_version() -> None:
    version = workspace_version()
    metadata = json.loads(subprocess.run(
        ["cargo", "metadata", "--no-deps", "--format-version", "1", "--offline"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout)
    members = set(metadata["workspace_members"])
    packages = [p for p in metadata["packages"] if p["id"] in members]
    assert len(packages) >= 7, [p["name"] for p in packages]
    assert {p["name"]: p["version"] for p in packages} == {p["name"]: version for p in packages}
    for package in packages:
        manifest = tomllib.loads(open(package["manifest_path"]).read())
        assert manifest["package"]["version"] == {"workspace": True}, package["manifest_path"]


def test_the_store_prints_it() -> None:
    out = subprocess.run([str(harness.store_binary()), "--version"], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == f"idempotency-store {workspace_version()}"


def test_the_filter_logs_it_once_per_vm(procs) -> None:
    upstream = procs.upstream()
    envoy = helpers.start_envoy(procs, upstream, helpers.sample_single_proxy_config(), concurrency=2)
    line = f"idempotency-filter {workspace_version()} loaded"
    if harness.FILTER_BUILD == "native":
        # One module in the process: said once, before its first configuration.
        harness.wait_until(lambda: line in envoy.log_text(), timeout=10, what=line)
        log = envoy.log_text()
        assert log.count(line) == 1
        assert log.index(line) < log.index("configured ")
        return
    # At least one VM per worker, and the main thread's.
    harness.wait_until(lambda: envoy.log_text().count(line) >= 3, timeout=10, what=line)
    # Each VM says it before its first configuration.
    for thread in {m.group(1) for m in re.finditer(r"\]\[(\d+)\]\[info\]\[wasm\].*configured", envoy.log_text())}:
        lines = [ln for ln in envoy.log_text().splitlines() if f"][{thread}][info][wasm]" in ln]
        assert line in lines[0], lines[:2]


def test_the_changelog_starts_at_this_version() -> None:
    headings = re.findall(r"^## (\S+)", (REPO / "CHANGELOG.md").read_text(), flags=re.MULTILINE)
    assert headings and headings[0] == workspace_version(), headings

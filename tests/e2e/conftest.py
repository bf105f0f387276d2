"""pytest fixtures over harness.py.

Every process a test starts through these fixtures is stopped by PID when the
test ends, pass or fail; on failure the tail of each process's log is printed
(shown under "Captured stdout teardown"). Logs and generated configs live in
the test's own ``tmp_path``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "alone: run by `make e2e` after the parallel pass, one at a time, on an unloaded "
        "machine (see the Makefile)",
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # Safety net: nothing survives the session, whatever happened.
    harness.stop_all_processes()


def _failed(request: pytest.FixtureRequest) -> bool:
    return any(
        getattr(getattr(request.node, f"rep_{when}", None), "failed", False)
        for when in ("setup", "call")
    )


@pytest.fixture
def procs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[harness.ProcessGroup]:
    """A ProcessGroup for this test: ``procs.upstream()``, ``procs.redis()``,
    ``procs.store(token=...)``, ``procs.envoy(config, ...)``, ``procs.process(argv, name=...)``."""
    group = harness.ProcessGroup(tmp_path)
    try:
        yield group
    finally:
        if _failed(request):
            for proc in group.processes():
                print(f"\n----- {proc.name} (pid {proc.pid}, exit {proc.returncode}) log tail: {proc.log_path}")
                print(proc.log_tail(80))
        group.close()


@pytest.fixture
def upstream(procs: harness.ProcessGroup) -> harness.Upstream:
    """A running demo-upstream with fresh counters."""
    return procs.upstream()


@pytest.fixture
def redis(procs: harness.ProcessGroup) -> harness.Redis:
    """A running redis-server without persistence."""
    return procs.redis()


@pytest.fixture
def envoy_factory(procs: harness.ProcessGroup) -> Callable[..., harness.Envoy]:
    """``envoy_factory(config, cluster_ports=..., plugin_config=..., wasm_path=...)``
    starts an Envoy (stopped at teardown); ``config`` defaults to envoy/envoy.yaml."""

    def make(config: Any = None, **kwargs: Any) -> harness.Envoy:
        return procs.envoy(config if config is not None else harness.default_envoy_config(), **kwargs)

    return make

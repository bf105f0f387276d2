"""The native module asks of Envoy only what the Envoy under test has: every Envoy callback
the built module imports (`envoy_dynamic_module_callback_*`, resolved when Envoy loads it) is
exported by that Envoy's binary. `make e2e-native` runs the suite on the oldest and the newest
Envoy the module supports, so each is checked against the module (1.38, for one, lacks two of
them: docs/envoy-versions.md)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import harness

PREFIX = "envoy_dynamic_module_callback_"

needs_the_module = pytest.mark.skipif(
    harness.FILTER_BUILD != "native", reason="reads the native module: runs in make e2e-native, which builds it")


def dynamic_symbols(path: Path, *, undefined: bool) -> set[str]:
    """The names in ``path``'s dynamic symbol table that start with PREFIX: those it imports
    (undefined) or those it defines."""
    table = subprocess.run(["readelf", "--dyn-syms", "--wide", str(path)],
                           capture_output=True, text=True, timeout=120, check=True).stdout
    names = set()
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 8 or not fields[7].startswith(PREFIX):
            continue
        if (fields[6] == "UND") == undefined:
            names.add(fields[7].split("@")[0])
    return names


def envoy_executable() -> Path:
    """The suite's Envoy binary itself: ``ENVOY_BIN`` may be pip's wrapper script, which execs
    the binary its package holds."""
    path = harness.envoy_binary().resolve()
    if path.read_bytes()[:4] == b"\x7fELF":
        return path
    found = sorted(path.parent.parent.glob("lib/python*/site-packages/envoy/_bin/envoy"))
    assert found, f"no Envoy binary behind {path}"
    return found[0]


@needs_the_module
def test_every_callback_the_module_imports_is_one_this_envoy_exports() -> None:
    module = harness.native_module_dir() / f"lib{harness.NATIVE_MODULE_NAME}.so"
    assert module.is_file(), f"{module} is not built: make native"
    imported = dynamic_symbols(module, undefined=True)
    assert len(imported) >= 20, f"the module imports only {sorted(imported)}: not the filter's module?"
    exported = dynamic_symbols(envoy_executable(), undefined=False)
    missing = sorted(imported - exported)
    assert not missing, f"Envoy {harness.envoy_version()} does not export {missing}"

"""Where a request's CPU goes: Envoy sampled with `perf` while it serves a setup's load, and the
module's own work counted in instructions under callgrind.

Envoy's V8 compiles the module to machine code at run time (TurboFan, no Liftoff), which
`perf` sees as anonymous JIT code, while Envoy's binary is stripped. So each sample falls in
one of four parts, told apart by where it is and by the call chain above it:

  module      machine code V8 generated: the filter's own work (and V8's wasm call stubs)
  host calls  Envoy's code with JIT code above it on the stack: the ABI calls the module makes
              (headers, body, shared data, properties, the local reply...) and V8's runtime
  Envoy       Envoy's code with no JIT code above it: its codec, router, filter chain, the
              callbacks into the module's context, everything a request costs without this
              filter's calls
  kernel      sockets and scheduling

The instruction count is deterministic where the machine's timing is not: the census loop
(crates/idempotency-core/src/journey/tests/census.rs) run natively under callgrind, per path,
by the release profile (the same optimisation levels as the module). Natively the fake host
stands in for Envoy and is counted too; valgrind hides the CPU's SHA instructions, so SHA-256
runs in software as it does on wasm32.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

PARTS = ("module", "host calls", "Envoy", "kernel")


@dataclass
class CpuSplit:
    """Shares of Envoy's sampled CPU, each part in [0, 1]."""

    samples: int
    shares: dict[str, float]


def perf_available() -> bool:
    if shutil.which("perf") is None:
        return False
    try:
        paranoid = int(Path("/proc/sys/kernel/perf_event_paranoid").read_text())
    except (OSError, ValueError):
        return False
    return paranoid <= 2


def start_record(pid: int, seconds: float, out: Path) -> subprocess.Popen:
    """Starts sampling `pid` for `seconds` (perf stops itself then) with call chains, at a rate
    low enough that the sampling does not shift what it measures; wait for it by its PID."""
    return subprocess.Popen(
        ["perf", "record", "-q", "-F", "499", "-g", "-p", str(pid), "-o", str(out), "--", "sleep", f"{seconds:.1f}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _is_jit(frame: str) -> bool:
    return "[JIT]" in frame or "/tmp/perf-" in frame or "//anon" in frame


def split(data: Path) -> CpuSplit:
    """Classifies every sample of `data` (a `perf record -g` file) into PARTS."""
    out = subprocess.run(["perf", "script", "-i", str(data), "-F", "ip,dso"], check=True,
                         capture_output=True, text=True, timeout=300).stdout
    counts = dict.fromkeys(PARTS, 0)
    chain: list[str] = []

    def close() -> None:
        if not chain:
            return
        leaf, callers = chain[0], chain[1:]
        if _is_jit(leaf):
            part = "module"
        elif "kernel" in leaf:
            part = "kernel"
        elif any(_is_jit(f) for f in callers):
            part = "host calls"
        else:
            part = "Envoy"
        counts[part] += 1
        chain.clear()

    for line in out.splitlines():
        if line.strip():
            chain.append(line.strip())
        else:
            close()
    close()
    total = sum(counts.values())
    return CpuSplit(total, {p: counts[p] / total if total else 0.0 for p in PARTS})


@dataclass
class Instructions:
    """Instructions per request of each census path, natively under callgrind."""

    per_path: dict[str, int]
    command: str


LOOP_PATHS = ("replay", "new_key")


def count_instructions(repo: Path, rounds: tuple[int, int] = (500, 1500)) -> Instructions | None:
    """Each path's loop run twice with different round counts: the difference over the extra
    rounds is one request's instructions, with the set-up (configuration, the first write)
    cancelled out. None without valgrind."""
    if shutil.which("valgrind") is None:
        return None
    built = subprocess.run(
        ["cargo", "test", "--release", "-p", "idempotency-core", "--lib", "--no-run", "--message-format=json"],
        cwd=repo, check=True, capture_output=True, text=True, timeout=1800).stdout
    binary = None
    for line in built.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg.get("executable") and \
                msg.get("target", {}).get("name") == "idempotency_core":
            binary = msg["executable"]
    if binary is None:
        raise RuntimeError("cargo built no test binary for idempotency-core")

    def collected(path: str, n: int) -> int:
        run = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", binary, "census_loop", "--ignored"],
            env={"PATH": "/usr/bin:/bin", "CENSUS_LOOP_ONLY": path, "CENSUS_LOOP_ROUNDS": str(n)},
            check=True, capture_output=True, text=True, timeout=900)
        for line in run.stderr.splitlines():
            if "Collected :" in line:
                return int(line.split()[-1])
        raise RuntimeError(f"callgrind reported no count for {path}")

    low, high = rounds
    per_path = {p: (collected(p, high) - collected(p, low)) // (high - low) for p in LOOP_PATHS}
    command = ("CENSUS_LOOP_ONLY=<path> CENSUS_LOOP_ROUNDS=<n> valgrind --tool=callgrind "
               "<cargo test --release -p idempotency-core --lib binary> census_loop --ignored")
    return Instructions(per_path, command)

"""gRPC's price: unary calls through envoy/envoy-grpc.yaml (single-proxy, one worker) to the
end-to-end tests' real gRPC service (grpcio, tests/e2e/grpc_service.py), loaded by grpcio's
own client (bench/grpc_load.py):

  (p) Envoy without the filter, new keys        the baseline the filter's cost is taken over
  (q) the filter, new calls                     claimed, executed, recorded
  (r) the filter, replays                       each through the hop to the replay echo

Beside them on the page: (a), (c) and (d), an HTTP write of the same body through
envoy/envoy.yaml, so that what the filter adds per gRPC call reads against what it adds per
HTTP write. The service and the load generator are Python and share the machine's two cores
with Envoy: the calls/s are theirs as much as Envoy's, and Envoy's CPU per call is the figure.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import harness
from measure import BODY, Durations, cpu_seconds, log
from setups import REPO, FILTER_WASM, without_wasm_filter

sys.path.insert(0, str(REPO / "tests" / "e2e"))
import grpc_calls  # noqa: E402  (tests/e2e/grpc_calls.py)

LOAD = REPO / "bench" / "grpc_load.py"
CONCURRENCY = 32


@dataclass
class GrpcRow:
    key: str
    title: str
    calls: int
    ok: int
    errors: dict[str, int]
    rps: float
    p50_ms: float
    p99_ms: float
    cpu_us: float
    # What the service ran, asked directly: a new call runs once, a replay never.
    executions: int = 0


def executions(server: grpc_calls.GrpcServer) -> dict[str, int]:
    """Executions per key, asked of the service directly: after a run of new keys the answer
    is megabytes, past grpcio's default 4 MiB limit."""
    options = [("grpc.max_receive_message_length", 256 << 20)]
    with grpc.insecure_channel(f"{harness.LOOPBACK}:{server.port}", options=options) as channel:
        raw = channel.unary_unary("/test.v1.Control/Executions")(b"", timeout=30)
    return json.loads(raw)["executions"]


def load(target: str, seconds: float, mode: str, key: str) -> dict:
    out = subprocess.run([sys.executable, str(LOAD), "--target", target, "--seconds", f"{seconds:g}",
                          "--concurrency", str(CONCURRENCY), "--mode", mode, "--key", key, "--message", BODY],
                         capture_output=True, text=True, timeout=seconds + 120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(envoy: harness.Envoy, durations: Durations, mode: str, key: str, key_name: str, title: str) -> GrpcRow:
    target = f"{harness.LOOPBACK}:{envoy.port}"
    if durations.warmup > 0:
        load(target, durations.warmup, mode, key if mode == "fixed" else "w" + key)
    pid = envoy.process.pid
    cpu0 = cpu_seconds(pid)
    r = load(target, durations.setup, mode, key)
    cpu = cpu_seconds(pid) - cpu0
    row = GrpcRow(key_name, title, r["calls"], r["ok"], r["errors"], r["rps"], r["p50_ms"], r["p99_ms"],
                  1e6 * cpu / max(1, r["calls"]))
    log(f"  ({key_name}) {title}: {row.rps:.0f} calls/s, p50 {row.p50_ms:.2f} ms, p99 {row.p99_ms:.2f} ms, "
        f"errors {row.errors or 0}, CPU {row.cpu_us:.0f} us/call")
    return row


def run_grpc_rows(tmp: Path, durations: Durations) -> list[GrpcRow]:
    rows: list[GrpcRow] = []
    tmp.mkdir(parents=True, exist_ok=True)
    with harness.ProcessGroup(tmp) as group:
        server = grpc_calls.start_server(group)
        nonce = str(int(time.time() * 1000))
        for key_name, title, plugin, mutate, mode in (
            ("p", "gRPC unary, Envoy without the filter", None, without_wasm_filter, "unique"),
            ("q", "gRPC unary, the filter, new calls", grpc_calls.yaml_plugin_config(), None, "unique"),
            ("r", "gRPC unary, the filter, replays through the echo hop", grpc_calls.yaml_plugin_config(), None,
             "fixed"),
        ):
            log(f"setup ({key_name}) {title}")
            envoy = group.add(harness.Envoy(
                grpc_calls.GRPC_ENVOY_YAML, tmp / key_name, cluster_ports={grpc_calls.SERVICE_CLUSTER: server.port},
                plugin_config=plugin, wasm_path=FILTER_WASM, mutate=mutate, name=f"envoy-{key_name}",
                concurrency=1, log_level="warn"))
            envoy.start(timeout=120)
            key = f"{key_name}{nonce}"
            if mode == "fixed":
                first = grpc_calls.call(envoy, key, BODY.encode())
                if first.code.name != "OK":
                    raise RuntimeError(f"priming the replay failed: {first.code} {first.details}")
            row = measure(envoy, durations, mode, key, key_name, title)
            counts = executions(server)
            row.executions = (counts.get(key, 0) if mode == "fixed"
                              else sum(n for k, n in counts.items() if k.startswith(f"{key}-")))
            rows.append(row)
            envoy.stop()
    return rows


def report(add, rows: list[GrpcRow], by: dict) -> list[tuple[str, bool | None, str]]:
    """The page's section, beside the HTTP setups (a), (c) and (d) of ``by``; returns what the
    targets table shows of it."""
    add("## gRPC's price")
    add("")
    if not rows:
        add("Not run.")
        add("")
        return []
    add("Unary calls of `/shop.v1.Orders/PlaceOrder` through [envoy/envoy-grpc.yaml](../envoy/envoy-grpc.yaml) "
        "(single-proxy, `--concurrency 1`), the same 22-byte body as the HTTP setups' writes, to the end-to-end "
        "tests' gRPC service (grpcio, [tests/e2e/grpc_service.py](../tests/e2e/grpc_service.py)), loaded by "
        f"grpcio's asyncio client with {CONCURRENCY} calls in flight ([bench/grpc_load.py](../bench/grpc_load.py); wrk "
        "cannot speak gRPC). The service and the client are Python and share the two cores with Envoy, so "
        "calls/s say more about them than about Envoy: Envoy's CPU per call is the figure. A replay takes the "
        "hop to the replay echo, an internal listener of the same Envoy, whose work is in that figure too. "
        "\"Executed\" is what the service counted: each new call once, the replayed key once in all.")
    add("")
    add("| setup | calls/s | p50 ms | p99 ms | Envoy CPU µs/call | executed | errors |")
    add("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        add(f"| ({r.key}) {r.title} | {r.rps:,.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} | {r.cpu_us:.0f} | "
            f"{r.executions:,} | {sum(r.errors.values()) if r.errors else 0} |")
    add("")
    row = {r.key: r for r in rows}
    lines = []
    targets = []
    if "p" in row and "q" in row:
        grpc_added = row["q"].cpu_us - row["p"].cpu_us
        text = f"{grpc_added:+.0f} µs of Envoy CPU per gRPC call over (p)"
        if "a" in by and "c" in by:
            http_added = by["c"].cpu_us_per_request - by["a"].cpu_us_per_request
            text += f", against {http_added:+.0f} µs per HTTP write for (c) over (a)"
        lines.append(f"- A new call: {text}.")
        targets.append(("gRPC new call: what the filter adds, beside an HTTP write", None, text))
    if "p" in row and "r" in row:
        text = f"{row['r'].cpu_us:.0f} µs of Envoy CPU per replayed call, the hop included ({row['p'].cpu_us:.0f} µs for a call that runs without the filter)"
        if "d" in by:
            text += f", against {by['d'].cpu_us_per_request:.0f} µs per replayed HTTP write (d)"
        lines.append(f"- A replay: {text}.")
        targets.append(("gRPC replay through the echo hop, beside an HTTP replay", None, text))
    for ln in lines:
        add(ln)
    add("")
    return targets

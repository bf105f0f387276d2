#!/usr/bin/env python3
"""What each step of a new key beyond the job floor costs, measured by removing it.

Builds the filter of HEAD several times in a scratch git worktree, each build with some of
its steps beyond the job floor (crates/job-floor-filter) edited out, and measures every build
against the unmodified one with `bench/run.py --abba` on setup (l) (new keys, a
`direct_response` route), then the job floor against the unmodified one. The builds are
measurements only: each drops a guarantee the product keeps (see docs/benchmarks.md).

The edits are literal source replacements: when the code they name changes, this script
stops with the file and text it no longer finds, rather than measure something else.

    bench/ablate.py [--only NAME,...] [--duration 10] [--warmup 3]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = Path("crates/idempotency-core/src")
WASM = "wasm32-unknown-unknown/release/idempotency_filter.wasm"
FLOOR = ROOT / "target/wasm32-unknown-unknown/release/job_floor_filter.wasm"

# name: (what it removes, [(file under CORE, text, replacement)])
STEPS: dict[str, tuple[str, list[tuple[str, str, str]]]] = {
    "registry": ("the table registry read before a new claim", [
        ("journey/claim.rs",
         "let catch_up = || plugin.upkeep.before_new_claim(host, &plugin.table, now);",
         "let catch_up = || {};"),
    ]),
    "who_answered": ("`response.code_details` and `upstream.request_attempt_count`", [
        ("who_answered.rs",
         "        let details = property(host, &[\"response\", \"code_details\"])\n"
         "            .and_then(|bytes| String::from_utf8(bytes).ok());\n"
         "        let attempts = property(host, &[\"upstream\", \"request_attempt_count\"])\n"
         "            .and_then(|bytes| integer(&bytes))\n"
         "            .map(|n| u32::try_from(n).unwrap_or(u32::MAX));",
         "        let details = Some(VIA_UPSTREAM.to_string());\n"
         "        let attempts = Some(1u32);"),
    ]),
    "router_retries": ("`x-envoy-max-retries: 0` on the way upstream", [
        ("journey/claim.rs",
         "    if let Err(e) = host.replace_request_header(NO_ROUTER_RETRIES, b\"0\") {",
         "    let _ = host;\n    if let Err(e) = Ok::<(), crate::host::HostError>(()) {"),
    ]),
    "key_expires": ("`idempotency-key-expires` on the answer recorded", [
        ("journey/response.rs",
         "        if let Err(e) = host.replace_response_header(KEY_EXPIRES_HEADER, expires.as_bytes()) {",
         "        if let Err(e) = Ok::<(), crate::host::HostError>(()) {"),
    ]),
    "route_metadata": ("the route's metadata naming a rule", [
        ("journey/intake.rs",
         "let metadata_rule = config.route_metadata_namespace.as_deref().and_then(|ns| {",
         "let metadata_rule = config.route_metadata_namespace.as_deref().filter(|_| false).and_then(|ns| {"),
    ]),
    "completion": ("the completion: the bucket read, the response and the slot's flip", [
        ("table/mod.rs",
         "        let Some(at) = held.slot else {\n            return Ok(Completion::NotHeld);\n        };\n"
         "        // The response is written without a cas",
         "        let Some(at) = held.slot else {\n            return Ok(Completion::NotHeld);\n        };\n"
         "        if held.slot.is_some() {\n"
         "            let _ = (shared, response, now_ms, ttl_ms, oversized, at);\n"
         "            return Ok(Completion::Recorded);\n        }\n"
         "        // The response is written without a cas"),
    ]),
}
BUILDS: dict[str, list[str]] = {
    **{name: [name] for name in STEPS},
    "all_but_completion": [n for n in STEPS if n != "completion"],
    "all": list(STEPS),
}


def run(cmd: list[str], cwd: Path, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, check=True, **kw)


def build(tree: Path, target: Path, steps: list[str], out: Path) -> None:
    run(["git", "checkout", "-q", "--", "."], tree)
    for step in steps:
        for rel, old, new in STEPS[step][1]:
            path = tree / CORE / rel
            text = path.read_text()
            if old not in text:
                raise SystemExit(f"{step}: {CORE / rel} no longer holds the text this edit replaces")
            path.write_text(text.replace(old, new, 1))
    run(["cargo", "build", "-q", "--release", "--target", "wasm32-unknown-unknown",
         "-p", "idempotency-filter"], tree, env={**os.environ, "CARGO_TARGET_DIR": str(target)},
        stderr=subprocess.DEVNULL)
    shutil.copyfile(target / WASM, out)
    run(["scripts/optimize-wasm.sh", str(out)], ROOT)


def abba(a: Path, b: Path, args: argparse.Namespace) -> str:
    done = run([sys.executable, "bench/run.py", "--abba", str(a), "--abba-b", str(b), "--only", "l",
                "--duration", str(args.duration), "--warmup", str(args.warmup),
                "--profile-seconds", "0"], ROOT, capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(BUILDS), help="builds to measure (comma-separated)")
    p.add_argument("--duration", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    if not FLOOR.is_file():
        raise SystemExit(f"{FLOOR} missing: run `make noop-wasm`")
    scratch = Path(tempfile.mkdtemp(prefix="idempotency-ablate-"))
    tree, target = scratch / "tree", scratch / "target"
    run(["git", "worktree", "add", "-q", "--detach", str(tree), "HEAD"], ROOT)
    try:
        base = scratch / "unmodified.wasm"
        build(tree, target, [], base)
        print("| build | removed | A: unmodified µs/req | B: this build µs/req | B − A |")
        print("| --- | --- | ---: | ---: | ---: |")
        for name in args.only.split(","):
            out = scratch / f"{name}.wasm"
            build(tree, target, BUILDS[name], out)
            cells = [c.strip() for c in abba(base, out, args).strip("|").split("|")]
            removed = "; ".join(STEPS[s][0] for s in BUILDS[name])
            print(f"| {name} | {removed} | {cells[1]} | {cells[2]} | {cells[3]} |", flush=True)
        cells = [c.strip() for c in abba(base, FLOOR, args).strip("|").split("|")]
        print(f"| job floor | (crates/job-floor-filter) | {cells[1]} | {cells[2]} | {cells[3]} |")
    finally:
        run(["git", "worktree", "remove", "--force", str(tree)], ROOT)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

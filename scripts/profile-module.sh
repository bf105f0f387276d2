#!/usr/bin/env bash
# Profiles the module's own work in V8, the engine Envoy runs it in: the census loop
# (crates/idempotency-core/src/journey/tests/census.rs, replay and new-key paths on the fake
# host) built for wasm32 by the release profile, with function names kept, run by
# wasm-bindgen-test-runner under Node with its CPU profiler; prints the time per request and
# the functions that took the most of it (self time). Usage: scripts/profile-module.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-20000}
out=$(mktemp -d /tmp/profile-module.XXXXXX)
# The runner starts `node` from PATH: a wrapper there turns its profiler on.
mkdir -p "$out/bin"
cat >"$out/bin/node" <<EOF
#!/bin/sh
exec $(command -v node) --cpu-prof --cpu-prof-dir=$out --cpu-prof-interval 200 "\$@"
EOF
chmod +x "$out/bin/node"
# A wasm32 test reads no environment: the rounds are fixed when it is built.
CENSUS_LOOP_ROUNDS=$rounds PATH="$out/bin:$PATH" \
    CARGO_TARGET_DIR=target/profile-module \
    CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=wasm-bindgen-test-runner \
    cargo test --config 'profile.release.strip=false' --release \
    --target wasm32-unknown-unknown -p idempotency-core --lib census_loop -- \
    --include-ignored --nocapture 2>&1 | grep 'census loop'
python3 - "$out"/*.cpuprofile <<'EOF'
import collections, json, re, sys
profile = json.load(open(sys.argv[1]))
nodes = {n["id"]: n for n in profile["nodes"]}
self_time = collections.Counter()
for sample, delta in zip(profile["samples"], profile["timeDeltas"][1:] + [0]):
    name = nodes[sample]["callFrame"]["functionName"] or "(anonymous)"
    self_time[re.sub(r"::h[0-9a-f]{16}$", "", name)] += delta
total = sum(self_time.values())
print("self time, share of the whole run (Node's start-up included):")
for name, t in self_time.most_common(25):
    print(f"{100 * t / total:5.1f} %  {name[:150]}")
EOF
rm -rf "$out"

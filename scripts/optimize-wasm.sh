#!/usr/bin/env bash
# Optimises a Wasm module in place with binaryen's wasm-opt (-O3), once per build of it: a
# request's CPU is what an Envoy operator pays for, the module's size a one-off per worker.
# rustc at opt-level 3 plus wasm-opt -O3 measured -4 us of Envoy CPU per request for new
# keys and for replays (bench/run.py --abba) against opt-level "z" plus -Oz, for a module of
# 684 KB instead of 516 KB (the target is 1 MiB). Only the features rustc enables for
# wasm32-unknown-unknown are allowed, so the output runs wherever the input ran.
# Without wasm-opt (scripts/install-deps.sh installs Debian's binaryen) the module is left
# as cargo built it, and a note says so.
#
# The module is rewritten through its inode: cargo's output is a hard link to its deps/
# artifact, which every later cargo build links again, so replacing the file would bring the
# unoptimised module back. `<module>.optimized` holds the optimised module's sha256.
set -euo pipefail
module=$1
stamp=$module.optimized
if [[ -f $stamp && $(sha256sum <"$module") == "$(cat "$stamp")" ]]; then
    exit 0 # this build was optimised already
fi
if ! command -v wasm-opt >/dev/null; then
    echo "note: wasm-opt not found (Debian package binaryen): $module left as cargo built it" >&2
    exit 0
fi
before=$(stat -c %s "$module")
wasm-opt -O3 --enable-bulk-memory --enable-multivalue --enable-mutable-globals \
    --enable-nontrapping-float-to-int --enable-reference-types --enable-sign-ext \
    "$module" -o "$module.tmp"
cat "$module.tmp" >"$module"
rm -f "$module.tmp"
sha256sum <"$module" >"$stamp"
echo "optimised $module: $before -> $(stat -c %s "$module") bytes"

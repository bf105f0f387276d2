#!/usr/bin/env bash
# Shrinks a Wasm module in place with binaryen's wasm-opt (-Oz), once per build of it: Envoy
# compiles the module once per worker and keeps it in every VM, and rustc's own size
# optimisation leaves about a fifth on the table. Only the features rustc enables for
# wasm32-unknown-unknown are allowed, so the output runs wherever the input ran.
# Without wasm-opt (scripts/install-deps.sh installs Debian's binaryen) the module is left
# as cargo built it, and a note says so.
set -euo pipefail
module=$1
stamp=$module.shrunk
if [[ -f $stamp && $stamp -nt $module ]]; then
    exit 0 # this build was shrunk already
fi
if ! command -v wasm-opt >/dev/null; then
    echo "note: wasm-opt not found (Debian package binaryen): $module left unshrunk" >&2
    exit 0
fi
before=$(stat -c %s "$module")
wasm-opt -Oz --enable-bulk-memory --enable-multivalue --enable-mutable-globals \
    --enable-nontrapping-float-to-int --enable-reference-types --enable-sign-ext \
    "$module" -o "$module.tmp"
mv "$module.tmp" "$module"
touch "$stamp"
echo "shrunk $module: $before -> $(stat -c %s "$module") bytes"

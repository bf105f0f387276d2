#!/usr/bin/env bash
# Shrinks a Wasm module in place with binaryen's wasm-opt (-Oz), once per build of it: Envoy
# compiles the module once per worker and keeps it in every VM, and rustc's own size
# optimisation leaves about a fifth on the table. Only the features rustc enables for
# wasm32-unknown-unknown are allowed, so the output runs wherever the input ran.
# Without wasm-opt (scripts/install-deps.sh installs Debian's binaryen) the module is left
# as cargo built it, and a note says so.
#
# The module is rewritten through its inode: cargo's output is a hard link to its deps/
# artifact, which every later cargo build links again, so replacing the file would bring the
# unshrunk module back. `<module>.shrunk` holds the shrunk module's sha256.
set -euo pipefail
module=$1
stamp=$module.shrunk
if [[ -f $stamp && $(sha256sum <"$module") == "$(cat "$stamp")" ]]; then
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
cat "$module.tmp" >"$module"
rm -f "$module.tmp"
sha256sum <"$module" >"$stamp"
echo "shrunk $module: $before -> $(stat -c %s "$module") bytes"

#!/usr/bin/env bash
# Writes dist/, the release a user installs (`make release`, after `make image`):
#
#   dist/idempotency_filter.wasm          the module, as `make build` wrote it
#   dist/idempotency_filter.wasm.sha256   its sha256 (sha256sum -c reads it)
#   dist/idempotency-store                the store, a static x86_64 Linux binary
#   dist/native/envoyE/libidempotency_native.so   the native build, an Envoy dynamic module
#   dist/native/envoyE/libidempotency_native.so.sha256   for Envoy E (NATIVE_ENVOY, e.g. 1.39-1.40),
#                                         which needs glibc (2.36 or older) and nothing else
#   dist/images/idempotency-store-V.oci.tar   the three images as OCI archives (gzip layers)
#   dist/images/idempotency-filter-V.oci.tar
#   dist/images/idempotency-native-V-envoyE.oci.tar
#   dist/images/digests                   each image's manifest digest
#   dist/deploy/                          deploy/ with every image pinned by REGISTRY and digest
#   dist/INSTALL.md, dist/CHANGELOG.md    how to install it, and what changed
#   dist/SHA256SUMS                       every file above
#
# REGISTRY (default localhost:5000) is where the manifests say the images are: make release
# REGISTRY=registry.example.com/team, then make push (or INSTALL.md's skopeo commands).
# DIST=path writes the release there instead of dist/ (the tests do).
set -euo pipefail
cd "$(dirname "$0")/.."

REGISTRY=${REGISTRY:-localhost:5000}
REGISTRY=${REGISTRY%/}
VERSION=${VERSION:-$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)}
NATIVE_ENVOY=$(scripts/images.sh native-envoy)
export REGISTRY VERSION NATIVE_ENVOY

WASM=target/wasm32-unknown-unknown/release/idempotency_filter.wasm
STORE=target/x86_64-unknown-linux-musl/release/idempotency-store
NATIVE=target/native/libidempotency_native.so
for f in "$WASM" "$STORE" "$NATIVE"; do
    [[ -f $f ]] || { echo "$f is missing: make image builds it" >&2; exit 1; }
done

dist=${DIST:-dist}
rm -rf "$dist"
mkdir -p "$dist/images"

cp "$WASM" "$dist/idempotency_filter.wasm"
(cd "$dist" && sha256sum idempotency_filter.wasm > idempotency_filter.wasm.sha256)
cp "$STORE" "$dist/idempotency-store"
"$dist/idempotency-store" --version | grep -qx "idempotency-store $VERSION" \
    || { echo "$STORE is not version $VERSION" >&2; exit 1; }

# The native module, in a directory named for the Envoy it is built for: a dynamic module is
# bound to the ABI of the Envoy it was built against. It must load in Envoy's images.
native_dir=native/envoy$NATIVE_ENVOY
mkdir -p "$dist/$native_dir"
cp "$NATIVE" "$dist/$native_dir/libidempotency_native.so"
(cd "$dist/$native_dir" && sha256sum libidempotency_native.so > libidempotency_native.so.sha256)
scripts/check-native-module.sh "$NATIVE"

scripts/images.sh archive "$dist/images"
store_digest=$(scripts/images.sh digest "$dist/images/idempotency-store-$VERSION.oci.tar")
module_digest=$(scripts/images.sh digest "$dist/images/idempotency-filter-$VERSION.oci.tar")
native_digest=$(scripts/images.sh digest "$dist/images/idempotency-native-$VERSION-envoy$NATIVE_ENVOY.oci.tar")
cat > "$dist/images/digests" <<EOF
$REGISTRY/idempotency-store:$VERSION sha256:$store_digest
$REGISTRY/idempotency-filter:$VERSION sha256:$module_digest
$REGISTRY/idempotency-native:$VERSION-envoy$NATIVE_ENVOY sha256:$native_digest
EOF

python3 scripts/render-manifests.py --registry "$REGISTRY" --version "$VERSION" \
    --store-digest "$store_digest" --module-digest "$module_digest" \
    --native-envoy "$NATIVE_ENVOY" --native-digest "$native_digest" deploy "$dist/deploy"

sed -e "s|@VERSION@|$VERSION|g" -e "s|@REGISTRY@|$REGISTRY|g" \
    -e "s|@STORE_DIGEST@|$store_digest|g" -e "s|@MODULE_DIGEST@|$module_digest|g" \
    -e "s|@MODULE_SHA256@|$(cut -d' ' -f1 "$dist/idempotency_filter.wasm.sha256")|g" \
    -e "s|@NATIVE_ENVOY@|$NATIVE_ENVOY|g" -e "s|@NATIVE_DIGEST@|$native_digest|g" \
    -e "s|@NATIVE_SHA256@|$(cut -d' ' -f1 "$dist/$native_dir/libidempotency_native.so.sha256")|g" \
    scripts/INSTALL.md.in > "$dist/INSTALL.md"
if grep -n '@[A-Z_]*@' "$dist/INSTALL.md"; then
    echo "INSTALL.md.in has a placeholder release.sh does not fill" >&2
    exit 1
fi
cp CHANGELOG.md "$dist/CHANGELOG.md"

(cd "$dist" && find . -type f ! -name SHA256SUMS | sed 's|^\./||' | LC_ALL=C sort | xargs sha256sum > SHA256SUMS)
echo "dist/ for $REGISTRY, version $VERSION:"
echo "  $REGISTRY/idempotency-store@sha256:$store_digest"
echo "  $REGISTRY/idempotency-filter@sha256:$module_digest"
echo "  $REGISTRY/idempotency-native@sha256:$native_digest (Envoy $NATIVE_ENVOY)"
echo "next: make push REGISTRY=$REGISTRY (or dist/INSTALL.md)"

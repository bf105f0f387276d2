#!/usr/bin/env bash
# Installs what this project needs and a fresh Debian machine lacks; does nothing for what is
# already there, so `make run` and `make test` can call it every time.
#   scripts/install-deps.sh                everything `make test` needs (--test-images's included)
#   scripts/install-deps.sh --run          only what `make run` needs
#   scripts/install-deps.sh --image        only what `make image`, `make release` and `make push`
#                                          need: a container engine (podman, unless a docker
#                                          daemon answers), skopeo, the musl target
#   scripts/install-deps.sh --test-images  what `make test-images` needs: --image's, podman
#                                          even next to docker, docker-registry, docker-compose
#   scripts/install-deps.sh --fuzz         only what `make fuzz` needs (cargo-fuzz; nightly must exist)
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-test}
case $mode in
    test | --run | --image | --test-images | --fuzz) ;;
    *) sed -n '4,11p' "$0" >&2; exit 2 ;;
esac
if [[ $mode == --fuzz ]]; then
    if ! rustup run nightly rustc --version >/dev/null 2>&1; then
        echo "make fuzz needs the nightly Rust toolchain (libFuzzer's instrumentation is nightly-only):" >&2
        echo "    rustup toolchain install nightly --profile minimal" >&2
        exit 1
    fi
    command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
    exit 0
fi
as_root=()
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null; then as_root=(sudo); fi
fi

# What builds and tests the images: make image, make release, make push (--image), and
# make test-images, which make test runs (--test-images, and the default).
images=false test_images=false
case $mode in
    --image) images=true ;;
    --test-images | test) images=true test_images=true ;;
esac

need_apt=()
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
command -v curl >/dev/null || need_apt+=(curl)
# Optimises the filter's module after cargo builds it (scripts/optimize-wasm.sh).
command -v wasm-opt >/dev/null || need_apt+=(binaryen)
if $images; then
    # An engine to build the images with: a docker daemon that answers will do for make image,
    # else podman (Debian's builds FROM scratch offline); the tests always run podman.
    if $test_images || ! { command -v docker >/dev/null && timeout 20 docker info >/dev/null 2>&1; }; then
        command -v podman >/dev/null || need_apt+=(podman)
    fi
    # Writes the release's OCI archives and copies them to a registry unchanged.
    command -v skopeo >/dev/null || need_apt+=(skopeo)
fi
if $test_images; then
    # A real registry on loopback, and the compose sample run against podman's API.
    command -v docker-registry >/dev/null || need_apt+=(docker-registry)
    # The runtime the tests fall back on where crun refuses hybrid cgroups (containers.py).
    command -v runc >/dev/null || need_apt+=(runc)
    command -v docker-compose >/dev/null || need_apt+=(docker-compose)
fi
if [[ $mode == test ]]; then
    command -v redis-server >/dev/null || need_apt+=(redis-server)
    command -v wrk >/dev/null || need_apt+=(wrk)
    command -v docker-compose >/dev/null || need_apt+=(docker-compose)
    command -v node >/dev/null || need_apt+=(nodejs)
    # The load balancer of the retrying-clients tests (tests/e2e/test_retrying_clients.py).
    command -v nginx >/dev/null || [[ -x /usr/sbin/nginx ]] || need_apt+=(nginx-light)
fi
if ((${#need_apt[@]})); then
    echo "installing Debian packages: ${need_apt[*]}"
    "${as_root[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq "${need_apt[@]}"
fi

rustup target list --installed | grep -qx wasm32-unknown-unknown || rustup target add wasm32-unknown-unknown
[[ $mode == --run ]] && exit 0
if $images; then
    # Static binaries for images on an empty base (and the release's store binary).
    rustup target list --installed | grep -qx x86_64-unknown-linux-musl || rustup target add x86_64-unknown-linux-musl
fi
[[ $mode == --image || $mode == --test-images ]] && exit 0

rustup component list --installed | grep -q '^clippy' || rustup component add clippy
rustup component list --installed | grep -q '^rustfmt' || rustup component add rustfmt
# The wasm32 test runner must match the wasm-bindgen crate in Cargo.lock. No registry ships it
# built, so it compiles (under 2 minutes on 2 cores): only the runner, the one binary `make
# test` uses, and without TLS, which only its client for a remote webdriver needs (the tests
# run under Node): 15% less CPU than the whole package. A debug build (--debug) would take
# 60% less again, but then every `make unit-wasm` runs twice as long (22 s more).
wb_version=$(awk '/^name = "wasm-bindgen"$/{getline; gsub(/"/,"",$3); print $3}' Cargo.lock)
if ! wasm-bindgen-test-runner --version 2>/dev/null | grep -q "$wb_version"; then
    cargo install wasm-bindgen-cli --version "$wb_version" --no-default-features --bin wasm-bindgen-test-runner
fi

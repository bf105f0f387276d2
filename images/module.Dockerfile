# The filter's Wasm module as an OCI image that Istio pulls (WasmPlugin `url: oci://...`,
# or the EnvoyFilter's remote code in deploy/istio/envoyfilter.yaml): the "compat" variant
# of the Wasm image specification Istio implements, an ordinary image whose single layer
# holds the module as plugin.wasm. Ordinary image tools (docker, podman, skopeo) and every
# registry handle it, and Istio reads it as such since WasmPlugin exists (1.12).
#
#   make image     builds it as $(REGISTRY)/idempotency-filter:$(VERSION) (see the Makefile)
#
# The context, target/image-context/module/, holds only plugin.wasm: a copy of
# target/wasm32-unknown-unknown/release/idempotency_filter.wasm as `make build` wrote it,
# byte for byte (tests/e2e/test_images.py checks the layer against it). Nothing is pulled.
FROM scratch

ARG VERSION=unknown
LABEL org.opencontainers.image.title="idempotency-filter" \
      org.opencontainers.image.description="Envoy proxy-wasm filter that makes retried HTTP writes take effect once" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"

COPY plugin.wasm /plugin.wasm

# The filter's native build, an Envoy dynamic module, as an OCI image that carries the file
# and nothing else: no shell, no entrypoint, never run as a container. A cluster takes the
# .so out of it and hands Envoy a local path:
#
# - a Kubernetes image volume (`volumes[].image.reference`, beta and on by default from
#   Kubernetes 1.35, with a runtime that implements it) mounted at /etc/envoy/dynamic-modules:
#   Envoy then reads /etc/envoy/dynamic-modules/libidempotency_native.so. Without image
#   volumes, an init container copies the file into an emptyDir mounted there; this image
#   has no cp to run, so the init container's image is one of yours with a shell that takes
#   the file from this one (`COPY --from=<this image> /libidempotency_native.so /`);
# - Envoy Gateway: the EnvoyProxy's `dynamicModules` entry with a local path to that file,
#   the volume mounted into the proxy's pod (deploy/envoy-gateway/);
# - Istio: an EnvoyFilter inserting the dynamic module filter, the volume mounted into the
#   gateway's pod (deploy/istio/native-envoyfilter.yaml).
#
# A dynamic module is built against one Envoy's ABI, so the tag says which: the image is
# $(REGISTRY)/idempotency-native:$(VERSION)-envoy$(NATIVE_ENVOY), e.g. 0.2.0-envoy1.40, and an
# Envoy upgrade needs the module built and tested for the new release.
#
#   make image     builds it (see the Makefile and scripts/images.sh)
#
# The context, target/image-context/native/, holds only libidempotency_native.so: a copy of
# target/native/libidempotency_native.so as `make native` wrote it, byte for byte
# (tests/e2e/test_images.py checks the layer against it). Nothing is pulled.
FROM scratch

ARG VERSION=unknown
ARG NATIVE_ENVOY=unknown
LABEL org.opencontainers.image.title="idempotency-native" \
      org.opencontainers.image.description="Envoy dynamic module (native build) of the idempotency filter, built for Envoy ${NATIVE_ENVOY}" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"

COPY libidempotency_native.so /libidempotency_native.so

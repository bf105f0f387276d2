# The filter's native build, an Envoy dynamic module, as an installer image: the .so and
# /install-module (crates/module-installer, a static binary), nothing else: no shell, no libc.
# Run as a Kubernetes init container, it copies the module into a directory shared with the
# Envoy container:
#
#   initContainers:
#     - name: install-idempotency-module
#       image: $(REGISTRY)/idempotency-native@sha256:...    # its ENTRYPOINT and CMD install
#       volumeMounts: [{name: dynamic-modules, mountPath: /modules}]   # into /modules
#   containers:
#     - name: envoy ...
#       volumeMounts: [{name: dynamic-modules, mountPath: /etc/envoy/dynamic-modules, readOnly: true}]
#   volumes: [{name: dynamic-modules, emptyDir: {}}]
#
# Envoy then reads /etc/envoy/dynamic-modules/libidempotency_native.so (deploy/envoy-gateway/
# and deploy/istio/native/gateway-patch.yaml). Why not mount this image as an image volume:
# Kubernetes mounts those noexec, so Envoy's dlopen of the module from one can fail. The copy
# is atomic (a temporary file renamed over the name) and prints the path, size and sha256 it
# installed; the argument is the target directory (/modules by default). Without Kubernetes,
# bake the module into an Envoy image of your own instead:
# `COPY --from=<this image> /libidempotency_native.so /etc/envoy/dynamic-modules/`.
#
# A dynamic module is built against one Envoy's ABI, so the tag says which: the image is
# $(REGISTRY)/idempotency-native:$(VERSION)-envoy$(NATIVE_ENVOY), e.g. 0.2.0-envoy1.39-1.40, and an
# Envoy upgrade needs the module built and tested for the new release.
#
#   make image     builds it (see the Makefile and scripts/images.sh)
#
# The context, target/image-context/native/, holds only libidempotency_native.so, a copy of
# target/native/libidempotency_native.so as `make native` wrote it, byte for byte, and
# install-module from `make static-binaries` (tests/e2e/test_images.py checks the layer
# against both, and runs the image as the init container does). Nothing is pulled.
FROM scratch

ARG VERSION=unknown
ARG NATIVE_ENVOY=unknown
LABEL org.opencontainers.image.title="idempotency-native" \
      org.opencontainers.image.description="Envoy dynamic module (native build) of the idempotency filter, built for Envoy ${NATIVE_ENVOY}, and install-module, which copies it into a directory (an init container's emptyDir)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"

# One COPY, one layer: the module and its installer.
COPY libidempotency_native.so install-module /

# Unprivileged, as the store's image: an emptyDir is writable by any user.
USER 65532:65532
ENTRYPOINT ["/install-module"]
CMD ["/modules"]

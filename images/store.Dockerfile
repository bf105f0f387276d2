# The idempotency store as a container image: one static binary on an empty base, so no
# shell, no libc, no package to patch; it runs as an unprivileged user (65532) and keeps its
# embedded database in the /data volume.
#
#   make image     builds it with docker or podman (whichever works), as
#                  $(REGISTRY)/idempotency-store:$(VERSION) (see the Makefile)
#
# `make image` compiles the store for x86_64-unknown-linux-musl (a static binary) and builds
# from a small context it prepares in target/image-context/store/: the binary and an empty
# data/ directory (so that /data exists and belongs to the store's user; a new volume
# mounted there starts with that owner). Nothing is pulled: this builds offline.
#
# With network access you may compile inside the usual Rust image instead, from the
# repository root (docker build -f images/store.Dockerfile .), by putting this stage first:
#
#   FROM docker.io/library/rust:1-bookworm AS build
#   WORKDIR /src
#   COPY . .
#   RUN rustup target add x86_64-unknown-linux-musl \
#    && cargo build --release --locked --target x86_64-unknown-linux-musl -p idempotency-store \
#    && mkdir -p /context/data \
#    && cp target/x86_64-unknown-linux-musl/release/idempotency-store /context/
#
# and `--from=build /context/` in the two COPY lines below (`COPY --from=build
# /context/idempotency-store /idempotency-store`, `COPY --from=build --chown=65532:65532
# /context/data/ /data/`). The final stage stays FROM scratch either way.
FROM scratch

ARG VERSION=unknown
LABEL org.opencontainers.image.title="idempotency-store" \
      org.opencontainers.image.description="Shared claim/complete store of the Envoy idempotency filter (cluster mode)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"

COPY idempotency-store /idempotency-store
COPY --chown=65532:65532 data/ /data/

USER 65532:65532
# The embedded backend's idempotency.redb goes here (--data-dir=/data). Also the working
# directory, so that even a command line without --data-dir writes into the volume.
VOLUME ["/data"]
WORKDIR /data
# The store's only port: its gRPC stream, its HTTP API, /healthz and /metrics.
EXPOSE 8081

# Every argument is the store's own flag (idempotency-store --help). The defaults below
# serve on every interface with the embedded backend; a token is still required, from
# --token-file (a mounted secret) or the IDEMPOTENCY_STORE_TOKEN environment variable, or
# the store refuses to start.
ENTRYPOINT ["/idempotency-store"]
CMD ["--listen=0.0.0.0:8081", "--backend=embedded", "--data-dir=/data"]

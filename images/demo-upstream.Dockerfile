# The counting demo upstream, for the Docker Compose sample (envoy/docker-compose.yaml) only;
# it is not part of a release. A static binary on an empty base, as the store's image.
#
#   make image     builds it as $(REGISTRY)/idempotency-demo-upstream:$(VERSION)
FROM scratch

ARG VERSION=unknown
LABEL org.opencontainers.image.title="idempotency-demo-upstream" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"

COPY demo-upstream /demo-upstream
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/demo-upstream"]
CMD ["--listen=0.0.0.0:8080"]

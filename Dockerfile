# syntax=docker/dockerfile:1
# The two teeguard images, one target each (the same images scripts/images.sh builds with buildah where
# no container registry is reachable: the root filesystem of both comes from scripts/image-root.sh):
#   docker build --target teeguard-webhook -t ghcr.io/teeguard/teeguard-webhook:0.1.0 .
#   docker build --target teeguard-agent   -t ghcr.io/teeguard/teeguard-agent:0.1.0 .
# Each is FROM scratch: the release binary, the libraries it links (glibc, libm, libgcc_s, the loader,
# from the Debian 12 build image), /etc/passwd with the non-root user 65532 the chart runs as, and /tmp.
# Multi-arch: `docker buildx build --platform linux/amd64,linux/arm64 ...` (.github/workflows/release.yml).

ARG RUST_VERSION=1.95

FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --locked --release -p teeguard-webhook -p teeguard-agent --bins \
    && scripts/image-root.sh target/release/teeguard-webhook /rootfs/teeguard-webhook \
    && scripts/image-root.sh target/release/teeguard-agent /rootfs/teeguard-agent

FROM scratch AS teeguard-webhook
ARG VERSION=0.1.0
ARG REVISION=unknown
COPY --from=build /rootfs/teeguard-webhook/ /
LABEL org.opencontainers.image.title="teeguard-webhook" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="https://github.com/teeguard/teeguard" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/usr/local/bin
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/teeguard-webhook"]

FROM scratch AS teeguard-agent
ARG VERSION=0.1.0
ARG REVISION=unknown
COPY --from=build /rootfs/teeguard-agent/ /
LABEL org.opencontainers.image.title="teeguard-agent" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="https://github.com/teeguard/teeguard" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/usr/local/bin
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/teeguard-agent"]

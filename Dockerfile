# syntax=docker/dockerfile:1
# One image per binary:
#   docker build --build-arg BINARY=teeguard-webhook -t ghcr.io/teeguard/teeguard-webhook:0.1.0 .
#   docker build --build-arg BINARY=teeguard-agent   -t ghcr.io/teeguard/teeguard-agent:0.1.0 .
# Both binaries are built with glibc (dynamic), so the runtime is distroless/cc (glibc + libgcc), nonroot
# (UID 65532, which the Helm chart also sets).

ARG RUST_VERSION=1.95
ARG BINARY=teeguard-webhook

FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --locked --release -p teeguard-webhook -p teeguard-agent \
    && mkdir -p /out \
    && cp target/release/teeguard-webhook target/release/teeguard-agent /out/

FROM gcr.io/distroless/cc-debian12:nonroot
ARG BINARY
LABEL org.opencontainers.image.source="https://github.com/teeguard/teeguard" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.title="${BINARY}"
COPY --from=build /out/${BINARY} /usr/local/bin/${BINARY}
USER 65532:65532
# No ENTRYPOINT: exec-form instructions cannot take the binary's name from a build argument. The binary is on
# PATH: `docker run IMAGE teeguard-webhook serve ...`; the Helm chart sets `command`.

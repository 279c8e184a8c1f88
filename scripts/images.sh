#!/usr/bin/env bash
# Builds the two teeguard images (teeguard-webhook, teeguard-agent) on a machine that reaches only package
# registries: release binaries from cargo, a root filesystem from scripts/image-root.sh (binary + the
# libraries it links + a non-root user), committed FROM scratch by buildah (Debian package `buildah`, vfs
# storage, no daemon) and written as OCI archives. The Dockerfile builds the same images where container
# registries are reachable.
#
#   scripts/images.sh                      # -> ./.tools/images/teeguard-{webhook,agent}.tar
#   OUT=/tmp/img TAG=dev scripts/images.sh
#   CONTAINERD=/run/containerd/containerd.sock scripts/images.sh   # also import into a containerd (k8s.io)
#
# Env:
#   OUT         where the archives go (default ./.tools/images)
#   REPO        image name prefix (default ghcr.io/teeguard, the chart's default repositories)
#   TAG         image tag (default: the workspace version, as the chart's appVersion)
#   PROFILE     cargo profile of the binaries (default release: the binaries a release ships; with dev,
#               as scripts/test.sh builds them, the image's copy is stripped of its debug info)
#   NO_BUILD=1  use the binaries already in target/<profile> (scripts/test.sh builds them first)
#   CONTAINERD  a containerd socket to import the archives into (namespace k8s.io); needs `ctr` on PATH
#               or in CTR
# Prints each image's name, manifest digest (with Debian `skopeo`), archive size and the build time. Needs
# root (buildah's vfs storage).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)

OUT=${OUT:-$PWD/.tools/images}
REPO=${REPO:-ghcr.io/teeguard}
PROFILE=${PROFILE:-release}
version=$(awk -F'"' '/^version = / { print $2; exit }' Cargo.toml)
TAG=${TAG:-$version}
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
# Reproducible timestamps: the commit's, not the build's.
created=$(git log -1 --format=%ct 2>/dev/null || echo 0)

if ! command -v buildah >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "images: installing buildah (Debian)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends buildah >/dev/null) \
      || { echo "images: apt-get install buildah failed" >&2; exit 1; }
  else
    echo "images: buildah not found (Debian: apt-get install buildah; run as root)" >&2
    exit 1
  fi
fi

target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
profile_dir=$PROFILE
[ "$PROFILE" = dev ] && profile_dir=debug
if [ -z "${NO_BUILD:-}" ]; then
  cargo build --locked --profile "$PROFILE" -p teeguard-webhook -p teeguard-agent --bins
fi

mkdir -p "$OUT"
store="$PWD/.tools/buildah"
B=(buildah --root "$store/root" --runroot "$store/run" --storage-driver vfs)
export BUILDAH_ISOLATION=chroot

for name in teeguard-webhook teeguard-agent; do
  bin="$target_dir/$profile_dir/$name"
  rootfs="$OUT/$name.rootfs"
  scripts/image-root.sh "$bin" "$rootfs"
  if [ "$PROFILE" = dev ]; then
    strip --strip-debug "$rootfs/usr/local/bin/$name" \
      || { echo "images: strip (Debian binutils) failed on the dev binary $name" >&2; exit 1; }
  fi
  image="$REPO/$name:$TAG"
  ctr=$("${B[@]}" from --name "$name-build-$$" scratch)
  trap '"${B[@]}" rm "$ctr" >/dev/null 2>&1 || true' EXIT
  "${B[@]}" copy --quiet "$ctr" "$rootfs" / >/dev/null
  "${B[@]}" config \
    --user 65532:65532 \
    --workingdir / \
    --entrypoint "[\"/usr/local/bin/$name\"]" \
    --env PATH=/usr/local/bin \
    --label org.opencontainers.image.title="$name" \
    --label org.opencontainers.image.version="$TAG" \
    --label org.opencontainers.image.revision="$revision" \
    --label org.opencontainers.image.source="https://github.com/teeguard/teeguard" \
    --label org.opencontainers.image.licenses=Apache-2.0 \
    "$ctr"
  "${B[@]}" commit --quiet --format oci --timestamp "$created" --rm "$ctr" "$image" >/dev/null
  trap - EXIT
  rm -f "$OUT/$name.tar"
  "${B[@]}" push --quiet "$image" "oci-archive:$OUT/$name.tar:$image"
  # The manifest's digest, as a runtime that imports the archive records it (for the chart's image.digest).
  digest=$(skopeo inspect --format '{{.Digest}}' "oci-archive:$OUT/$name.tar" 2>/dev/null || echo "(skopeo not found)")
  rm -rf "$rootfs"
  printf 'images: %s  %s  %s KiB  %s\n' "$image" "$digest" "$(( $(stat -c %s "$OUT/$name.tar") / 1024 ))" "$OUT/$name.tar"
  if [ -n "${CONTAINERD:-}" ]; then
    "${CTR:-ctr}" -a "$CONTAINERD" -n k8s.io images import "$OUT/$name.tar" >/dev/null
    echo "images: imported $image into $CONTAINERD (namespace k8s.io)"
  fi
done
echo "images: built in $(( $(date +%s) - started )) s"

#!/usr/bin/env bash
# Lays out the root filesystem of one teeguard image: the binary, the shared libraries it links (glibc,
# libm, libgcc_s, the loader: the same files a distroless/cc image carries, taken from the machine that
# built the binary), /etc/passwd and /etc/group with the non-root user the chart runs as (65532), and a
# world-writable /tmp. Nothing else: no shell, no package manager.
#
#   scripts/image-root.sh BINARY ROOTFS
#
# Both image builds use it, so they describe the same image: scripts/images.sh (buildah, on a machine
# that reaches only package registries) and the Dockerfile (docker/buildx, for a release).
# Needs: ldd (libc-bin), cp, install.
set -euo pipefail
bin=${1:?usage: image-root.sh BINARY ROOTFS}
root=${2:?usage: image-root.sh BINARY ROOTFS}
[ -x "$bin" ] || { echo "image-root: $bin is not an executable file (build it first)" >&2; exit 1; }
command -v ldd >/dev/null || { echo "image-root: ldd not found (Debian: libc-bin)" >&2; exit 1; }

rm -rf "$root"
install -d -m 0755 "$root/usr/local/bin" "$root/etc"
install -d -m 1777 "$root/tmp"
install -m 0755 "$bin" "$root/usr/local/bin/$(basename "$bin")"

# Every library the dynamic loader resolves for the binary, at the path the binary asks for (the loader's
# path is compiled into the binary: /lib64/ld-linux-x86-64.so.2 on x86_64, /lib/ld-linux-aarch64.so.1 on
# arm64). `cp -L` copies the file a symlink points at.
libs=$(ldd "$bin" | awk '/=> \// { print $3 } /^\t\// { print $1 }')
[ -n "$libs" ] || { echo "image-root: ldd found no libraries for $bin (a static binary needs none; this one is not)" >&2; exit 1; }
for lib in $libs; do
  install -d -m 0755 "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
  chmod 0755 "$root$lib"
done

cat > "$root/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/sbin/nologin
nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin
EOF
cat > "$root/etc/group" <<'EOF'
root:x:0:
nonroot:x:65532:
EOF
chmod 0644 "$root/etc/passwd" "$root/etc/group"

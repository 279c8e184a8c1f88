# shellcheck shell=bash
# Makes a real node available to the real-node tests (tests/tests/node_*.rs): installs what its binaries
# need from Debian (runc, busybox-static, containernetworking-plugins, curl, conmon, skopeo; only when
# missing, and only as root), unpacks the binaries of ../shared/node-runtime (containerd, CRI-O,
# kubelet, crictl, ...; xz-compressed, checked against its SHA256SUMS) with its helper scripts into
# ./.tools/node-runtime and exports TEEGUARD_NODE_RUNTIME.
#   source scripts/node-runtime.sh     (scripts/test.sh does)
# Already set TEEGUARD_NODE_RUNTIME (your own binaries, plain or .xz): left as it is.
# With CI=true the real-node tests must run: anything missing fails here, and the tests fail too if the
# variable is unset. Without CI they skip, saying what is missing.

_teeguard_node_runtime() {
  local root src dest missing=() pkgs=() b
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
  if [ -n "${TEEGUARD_NODE_RUNTIME:-}" ]; then
    echo "node-runtime: using TEEGUARD_NODE_RUNTIME=$TEEGUARD_NODE_RUNTIME" >&2
    return 0
  fi
  src="$root/../shared/node-runtime"
  _nr_unavailable() {
    if [ "${CI:-}" = true ]; then
      echo "node-runtime: $1, and CI=true requires the real-node tests" >&2
      return 1
    fi
    echo "node-runtime: $1; the real-node tests will skip" >&2
    return 0
  }
  if [ ! -f "$src/kubelet.xz" ]; then
    _nr_unavailable "no $src"
    return
  fi
  # The Debian packages the node needs, by the command each provides.
  command -v runc >/dev/null 2>&1 || pkgs+=(runc)
  [ -x /bin/busybox ] || command -v busybox >/dev/null 2>&1 || pkgs+=(busybox-static)
  [ -x /usr/lib/cni/loopback ] || pkgs+=(containernetworking-plugins)
  command -v curl >/dev/null 2>&1 || pkgs+=(curl)
  command -v conmon >/dev/null 2>&1 || pkgs+=(conmon)
  command -v skopeo >/dev/null 2>&1 || pkgs+=(skopeo)
  command -v python3 >/dev/null 2>&1 || pkgs+=(python3)
  command -v xz >/dev/null 2>&1 || pkgs+=(xz-utils)
  if [ ${#pkgs[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      echo "node-runtime: apt-get install ${pkgs[*]}" >&2
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null) \
        || echo "node-runtime: apt-get install ${pkgs[*]} failed" >&2
    fi
    for b in runc busybox conmon skopeo python3 xz curl; do
      command -v "$b" >/dev/null 2>&1 || missing+=("$b")
    done
    [ -x /usr/lib/cni/loopback ] || missing+=("/usr/lib/cni/loopback")
    if [ ${#missing[@]} -gt 0 ]; then
      _nr_unavailable "missing ${missing[*]} (Debian: apt-get install ${pkgs[*]}, as root)"
      return
    fi
  fi
  dest="$root/.tools/node-runtime"
  mkdir -p "$dest" || return 1
  # Unpack again only what is missing or differs from the published checksums.
  if ! (cd "$dest" && sha256sum --quiet -c "$src/SHA256SUMS" >/dev/null 2>&1); then
    for b in $(awk '{print $2}' "$src/SHA256SUMS"); do
      xz -T0 -dc "$src/$b.xz" > "$dest/$b.part" && chmod +x "$dest/$b.part" && mv "$dest/$b.part" "$dest/$b" || {
        echo "node-runtime: cannot unpack $src/$b.xz" >&2
        return 1
      }
    done
    if ! (cd "$dest" && sha256sum --quiet -c "$src/SHA256SUMS"); then
      echo "node-runtime: the unpacked binaries do not match $src/SHA256SUMS" >&2
      return 1
    fi
  fi
  # The helpers the harness runs beside the binaries (the OCI runtime wrapper, the image writer).
  for b in runc-record make-oci-image.py; do
    install -m 0755 "$src/$b" "$dest/$b" || return 1
  done
  export TEEGUARD_NODE_RUNTIME="$dest"
  echo "node-runtime: TEEGUARD_NODE_RUNTIME=$TEEGUARD_NODE_RUNTIME ($("$dest/kubelet" --version 2>/dev/null))" >&2
}

_teeguard_node_runtime || return 1 2>/dev/null || exit 1

# shellcheck shell=bash
# Makes a real Kubernetes control plane available to the real-cluster tests (tests/tests/cluster_*.rs):
# unpacks the binaries of ../shared/control-plane (kube-apiserver, kube-scheduler,
# kube-controller-manager, etcd; xz-compressed, checked against its SHA256SUMS) into
# ./.tools/control-plane and exports TEEGUARD_CONTROL_PLANE.
#   source scripts/control-plane.sh     (scripts/test.sh does)
# Already set TEEGUARD_CONTROL_PLANE (your own binaries, plain or .xz): left as it is.
# With CI=true the real-cluster tests must run: a missing control plane fails here, and the tests
# fail too if the variable is unset. Without CI they skip, saying how to provide binaries.
# Needs xz and sha256sum (Debian: xz-utils, coreutils); bash runs each component under a watchdog.

_teeguard_control_plane() {
  local root src dest
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
  if [ -n "${TEEGUARD_CONTROL_PLANE:-}" ]; then
    echo "control-plane: using TEEGUARD_CONTROL_PLANE=$TEEGUARD_CONTROL_PLANE" >&2
    return 0
  fi
  src="$root/../shared/control-plane"
  if [ ! -f "$src/kube-apiserver.xz" ]; then
    if [ "${CI:-}" = true ]; then
      echo "control-plane: $src has no binaries, and CI=true requires the real-cluster tests" >&2
      return 1
    fi
    echo "control-plane: no $src; the real-cluster tests will skip" >&2
    return 0
  fi
  if ! command -v xz >/dev/null 2>&1; then
    echo "control-plane: xz not found (Debian: apt-get install xz-utils)" >&2
    return 1
  fi
  dest="$root/.tools/control-plane"
  mkdir -p "$dest" || return 1
  # Unpack again only what is missing or differs from the published checksums.
  if ! (cd "$dest" && sha256sum --quiet -c "$src/SHA256SUMS" >/dev/null 2>&1); then
    local b
    for b in etcd kube-apiserver kube-scheduler kube-controller-manager; do
      xz -T0 -dc "$src/$b.xz" > "$dest/$b.part" && chmod +x "$dest/$b.part" && mv "$dest/$b.part" "$dest/$b" || {
        echo "control-plane: cannot unpack $src/$b.xz" >&2
        return 1
      }
    done
    if ! (cd "$dest" && sha256sum --quiet -c "$src/SHA256SUMS"); then
      echo "control-plane: the unpacked binaries do not match $src/SHA256SUMS" >&2
      return 1
    fi
  fi
  # Kubernetes v1.30.14 (kube-apiserver, kube-scheduler, kube-controller-manager; etcd is the top one's)
  # for TEEGUARD_KUBE_VERSION=v1.30.14 (scripts/test.sh runs the cluster tests on it too).
  local v=v1.30.14
  if [ -f "$src/versions/$v/SHA256SUMS" ]; then
    mkdir -p "$dest/versions/$v" || return 1
    if ! (cd "$dest/versions/$v" && sha256sum --quiet -c "$src/versions/$v/SHA256SUMS" >/dev/null 2>&1); then
      for b in kube-apiserver kube-scheduler kube-controller-manager; do
        xz -T0 -dc "$src/versions/$v/$b.xz" > "$dest/versions/$v/$b.part" && chmod +x "$dest/versions/$v/$b.part" \
          && mv "$dest/versions/$v/$b.part" "$dest/versions/$v/$b" || {
          echo "control-plane: cannot unpack $src/versions/$v/$b.xz" >&2
          return 1
        }
      done
      if ! (cd "$dest/versions/$v" && sha256sum --quiet -c "$src/versions/$v/SHA256SUMS"); then
        echo "control-plane: the unpacked $v binaries do not match $src/versions/$v/SHA256SUMS" >&2
        return 1
      fi
    fi
  fi
  export TEEGUARD_CONTROL_PLANE="$dest"
  echo "control-plane: TEEGUARD_CONTROL_PLANE=$TEEGUARD_CONTROL_PLANE ($("$dest/kube-apiserver" --version 2>/dev/null))" >&2
}

_teeguard_control_plane || return 1 2>/dev/null || exit 1

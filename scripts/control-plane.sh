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
  # The top level (v1.36.2 and etcd) and Kubernetes v1.30.14 under versions/ (kube-apiserver,
  # kube-scheduler, kube-controller-manager; TEEGUARD_KUBE_VERSION=v1.30.14, which scripts/test.sh runs
  # the cluster tests on too), each directory's binaries named by its SHA256SUMS. Unpack again only what
  # is missing or differs from the published checksums.
  local sub b
  for sub in . versions/v1.30.14; do
    [ -f "$src/$sub/SHA256SUMS" ] || continue
    mkdir -p "$dest/$sub" || return 1
    if ! (cd "$dest/$sub" && sha256sum --quiet -c "$src/$sub/SHA256SUMS" >/dev/null 2>&1); then
      for b in $(awk '{ print $2 }' "$src/$sub/SHA256SUMS"); do
        xz -T0 -dc "$src/$sub/$b.xz" > "$dest/$sub/$b.part" && chmod +x "$dest/$sub/$b.part" \
          && mv "$dest/$sub/$b.part" "$dest/$sub/$b" || {
          echo "control-plane: cannot unpack $src/$sub/$b.xz" >&2
          return 1
        }
      done
      if ! (cd "$dest/$sub" && sha256sum --quiet -c "$src/$sub/SHA256SUMS"); then
        echo "control-plane: the unpacked binaries in $dest/$sub do not match $src/$sub/SHA256SUMS" >&2
        return 1
      fi
    fi
  done
  export TEEGUARD_CONTROL_PLANE="$dest"
  echo "control-plane: TEEGUARD_CONTROL_PLANE=$TEEGUARD_CONTROL_PLANE ($("$dest/kube-apiserver" --version 2>/dev/null))" >&2
}

_teeguard_control_plane || return 1 2>/dev/null || exit 1

# shellcheck shell=bash
# Makes KubeVirt's own virt-controller available to the KubeVirt tests (tests/tests/kubevirt_*.rs):
# unpacks virt-controller, kvtool and crds.yaml of ../shared/kubevirt (xz-compressed, checked against its
# SHA256SUMS) into ./.tools/kubevirt (v1.9.0; v1.7.4 and v1.8.4 into versions/<tag>/) and exports
# TEEGUARD_KUBEVIRT.
#   source scripts/kubevirt.sh     (scripts/test.sh does)
# Already set TEEGUARD_KUBEVIRT: left as it is. With CI=true the KubeVirt tests must run: a missing kit
# fails here. Needs xz and sha256sum (Debian: xz-utils, coreutils) and unshare (util-linux).

_teeguard_kubevirt() {
  local root src dest f
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
  if [ -n "${TEEGUARD_KUBEVIRT:-}" ]; then
    echo "kubevirt: using TEEGUARD_KUBEVIRT=$TEEGUARD_KUBEVIRT" >&2
    return 0
  fi
  src="$root/../shared/kubevirt"
  if [ ! -f "$src/virt-controller.xz" ]; then
    if [ "${CI:-}" = true ]; then
      echo "kubevirt: $src has no virt-controller, and CI=true requires the KubeVirt tests" >&2
      return 1
    fi
    echo "kubevirt: no $src; the KubeVirt tests will skip" >&2
    return 0
  fi
  dest="$root/.tools/kubevirt"
  # v1.9.0 at the top, v1.7.4 and v1.8.4 under versions/<tag>/ (the layout of ../shared/kubevirt).
  local sub
  for sub in . versions/v1.7.4 versions/v1.8.4; do
    mkdir -p "$dest/$sub" || return 1
    if ! (cd "$dest/$sub" && sha256sum --quiet -c "$src/$sub/SHA256SUMS" >/dev/null 2>&1); then
      for f in virt-controller kvtool crds.yaml; do
        xz -T0 -dc "$src/$sub/$f.xz" > "$dest/$sub/$f.part" && mv "$dest/$sub/$f.part" "$dest/$sub/$f" || {
          echo "kubevirt: cannot unpack $src/$sub/$f.xz" >&2
          return 1
        }
      done
      chmod 755 "$dest/$sub/virt-controller" "$dest/$sub/kvtool"
      if ! (cd "$dest/$sub" && sha256sum --quiet -c "$src/$sub/SHA256SUMS"); then
        echo "kubevirt: the unpacked files in $dest/$sub do not match $src/$sub/SHA256SUMS" >&2
        return 1
      fi
    fi
  done
  export TEEGUARD_KUBEVIRT="$dest"
  echo "kubevirt: TEEGUARD_KUBEVIRT=$TEEGUARD_KUBEVIRT (virt-controller v1.9.0; v1.7.4 and v1.8.4 in versions/)" >&2
}

_teeguard_kubevirt || return 1 2>/dev/null || exit 1

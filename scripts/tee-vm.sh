# shellcheck shell=bash
# Makes a real Linux misc cgroup controller available to the kernel tests (tests/tests/kernel_*.rs):
# prepares the ../shared/tee-vm kit (Debian's kernel booted under QEMU with a busybox initramfs and the
# fake_tee module; see its README.md) for two kernels, each in its own TEEVM_HOME under
# ./.tools/tee-vm (the kit itself stays read-only), and exports TEEGUARD_TEE_VM=./.tools/tee-vm:
#   6.1/   Debian 12's default kernel (what linux-image-amd64 depends on: no root misc.current)
#   6.12/  Debian 12's 6.12 line (what linux-image-6.12-amd64 depends on: root misc.current, misc.peak,
#          misc.events.local)
# The kit's setup.sh installs its Debian packages (qemu-system-x86, the kernel headers, gcc, ...) and
# unpacks the kernel, busybox and runc from their .debs; build-module.sh builds fake_tee.ko for that
# kernel, build-initramfs.sh the guest. virtio_net is kept too (EXTRA_MODS): the agent's tests reach the
# API server through QEMU's user-mode network. A kernel is rebuilt only when its KVER or the kit changed.
# Also exports TEEVM_ACCEL=tcg when KVM cannot boot the guest here (probed once), so the tests do not
# try KVM in every test binary.
#   source scripts/tee-vm.sh     (scripts/test.sh does)
# Already set TEEGUARD_TEE_VM: left as it is. With CI=true the kernel tests must run: anything missing
# fails here (and the tests fail too). Without CI they skip, saying what is missing. Needs root.

_teeguard_tee_vm() {
  local root kit dest line kver stamp want meta
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
  if [ -n "${TEEGUARD_TEE_VM:-}" ]; then
    echo "tee-vm: using TEEGUARD_TEE_VM=$TEEGUARD_TEE_VM" >&2
    return 0
  fi
  kit="$root/../shared/tee-vm"
  _tv_unavailable() {
    if [ "${CI:-}" = true ]; then
      echo "tee-vm: $1, and CI=true requires the kernel tests" >&2
      return 1
    fi
    echo "tee-vm: $1; the kernel tests will skip" >&2
    return 0
  }
  [ -x "$kit/setup.sh" ] || { _tv_unavailable "no kit in $kit"; return; }
  [ "$(id -u)" = 0 ] || { _tv_unavailable "not root (the kit installs Debian packages and builds a cpio with device nodes)"; return; }
  command -v apt-get >/dev/null 2>&1 || { _tv_unavailable "no apt-get (the kit takes its kernels from Debian 12's archive)"; return; }
  apt-cache show linux-image-6.12-amd64 >/dev/null 2>&1 || apt-get update -qq || return 1
  dest="$root/.tools/tee-vm"
  # The kit's own files: a change to any of them rebuilds both kernels' guests.
  want=$(cd "$kit" && find . -type f ! -path './results/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
  for line in 6.1 6.12; do
    case "$line" in
    6.1) meta=linux-image-amd64 ;;
    6.12) meta=linux-image-6.12-amd64 ;;
    esac
    kver=$(apt-cache depends "$meta" 2>/dev/null | sed -n 's/^ *Depends: linux-image-\(.*\)$/\1/p' | head -1)
    [ -n "$kver" ] || { echo "tee-vm: cannot tell which kernel $meta depends on (apt-cache depends $meta)" >&2; return 1; }
    stamp="$dest/$line/build/teeguard-ready"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$kver $want" ]; then
      echo "tee-vm: preparing Linux $line ($kver) in $dest/$line" >&2
      mkdir -p "$dest/$line" || return 1
      rm -f "$stamp"
      (
        export TEEVM_HOME="$dest/$line" KVER="$kver" EXTRA_MODS="virtio_net"
        rm -rf "$TEEVM_HOME/build" &&
          "$kit/setup.sh" >"$dest/$line.setup.log" 2>&1 &&
          "$kit/build-module.sh" >>"$dest/$line.setup.log" 2>&1 &&
          "$kit/build-initramfs.sh" >>"$dest/$line.setup.log" 2>&1
      ) || {
        tail -20 "$dest/$line.setup.log" >&2
        echo "tee-vm: preparing Linux $line failed; the whole log: $dest/$line.setup.log" >&2
        return 1
      }
      echo "$kver $want" >"$stamp"
    fi
  done
  export TEEGUARD_TEE_VM="$dest"
  if [ -z "${TEEVM_ACCEL:-}" ]; then
    # One boot with an empty script: the kit tries KVM first and says which accelerator it used.
    printf 'exit 0\n' >"$dest/probe.sh"
    if TEEVM_HOME="$dest/6.1" "$kit/run.sh" -t 120 "$dest/probe.sh" 2>"$dest/probe.log" >/dev/null &&
      grep -q 'accel=tcg' "$dest/probe.log"; then
      export TEEVM_ACCEL=tcg
    fi
  fi
  echo "tee-vm: TEEGUARD_TEE_VM=$TEEGUARD_TEE_VM ($(cat "$dest/6.1/build/KVER"), $(cat "$dest/6.12/build/KVER"); accelerator: ${TEEVM_ACCEL:-kvm, falling back to tcg})" >&2
}

_teeguard_tee_vm || return 1 2>/dev/null || exit 1

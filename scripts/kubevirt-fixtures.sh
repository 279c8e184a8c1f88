#!/usr/bin/env bash
# Renders tests/fixtures/kubevirt-v1.9.0/ again with KubeVirt v1.9.0's own code: each sample VMI through
# virt-api's defaulting (kvtool) and the real virt-controller, on the real control plane.
#   scripts/kubevirt-fixtures.sh
# Needs ../shared/control-plane and ../shared/kubevirt (or TEEGUARD_CONTROL_PLANE, TEEGUARD_KUBEVIRT) and root.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/control-plane.sh
source scripts/control-plane.sh
# shellcheck source=scripts/kubevirt.sh
source scripts/kubevirt.sh
TEEGUARD_REGENERATE_FIXTURES=1 CI=true cargo test -p teeguard-tests --test kubevirt_fixtures
git status --short tests/fixtures/kubevirt-v1.9.0

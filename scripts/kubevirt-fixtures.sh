#!/usr/bin/env bash
# Renders tests/fixtures/kubevirt-v1.9.0/, -v1.8.4/ and -v1.7.4/ again with each release's own code: each
# sample VMI through virt-api's defaulting (kvtool) and the real virt-controller, on the real control plane
# (the older releases' tests stop after writing their files).
#   scripts/kubevirt-fixtures.sh
# Needs ../shared/control-plane and ../shared/kubevirt (or TEEGUARD_CONTROL_PLANE, TEEGUARD_KUBEVIRT) and root.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/control-plane.sh
source scripts/control-plane.sh
# shellcheck source=scripts/kubevirt.sh
source scripts/kubevirt.sh
export TEEGUARD_REGENERATE_FIXTURES=1 CI=true
cargo test -p teeguard-tests --test kubevirt_nodes -- --exact \
  the_committed_kubevirt_objects_are_what_kubevirt_v1_9_renders
cargo test -p teeguard-tests --test kubevirt_v1_7 --test kubevirt_v1_8
git status --short tests/fixtures/kubevirt-v1.*

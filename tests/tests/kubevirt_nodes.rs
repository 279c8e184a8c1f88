//! KubeVirt v1.9.0's own virt-controller (`teeguard_tests::kubevirt`) on two real nodes (kubelet +
//! containerd each; one a TDX host, one an SEV-SNP host, each with its own agent): VMIs as users write
//! them become the controller's launcher pods, go through teeguard's webhook, the scheduler, the kubelet
//! and containerd, which asks the agent over NRI. Skipped (one line) without the KubeVirt kit, the
//! node's binaries or root, unless `CI=true`.

mod chart_support;
mod kubevirt_support;

use kubevirt_support::scenarios::{self, DEADLINE};
use teeguard_tests::realcluster::within;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vmis_of_each_kind_run_on_the_node_of_their_kind_with_one_key_on_compute() {
    within(DEADLINE, scenarios::each_kind_runs_limited_on_its_node()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn explore_full_node() {
    within(DEADLINE, scenarios::explore_full_node()).await;
}

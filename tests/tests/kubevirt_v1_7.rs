//! KubeVirt v1.7.4's own virt-controller and virt-api code (`../shared/kubevirt/versions/v1.7.4/`) on
//! the two real nodes of `kubevirt_nodes.rs`, with teeguard in the path: what this release renders, and
//! its VMIs limited, refused on a full node and started when a key frees (`kubevirt_support::versions`).
//! Skipped (one line) without the KubeVirt kit, the node's binaries or root, unless `CI=true`.

mod chart_support;
mod kubevirt_support;

use kubevirt_support::scenarios::DEADLINE;
use kubevirt_support::versions;
use teeguard_tests::kubevirt::Version;
use teeguard_tests::realcluster::within;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubevirt_v1_7_renders_the_committed_objects_and_its_vmis_run_limited_wait_and_start() {
    within(
        DEADLINE,
        versions::older_release_renders_runs_limited_refuses_and_starts(Version::V1_7_4),
    )
    .await;
}
